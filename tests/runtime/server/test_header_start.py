"""The server tells the engine where a chat prompt's generation prompt starts (`ChatPrompt.header_start`): the next
turn re-renders what follows it (a reply without its thinking), so a hybrid model keeps its state there."""

from __future__ import annotations

from ft.runtime.server.generation import render_chat
from ft.runtime.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3 + 3?"}]


def test_header_start_is_where_the_generation_prompt_begins(server):
    tok = server.tokenizer
    p = render_chat(tok, CHAT, [])
    bare = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=False))
    assert 0 < p.header_start < len(p.ids) and p.ids[:p.header_start] == bare
    assert tok.decode(p.ids[p.header_start:]).startswith("<|im_start|>assistant")
    # the next turn's prompt shares everything up to this turn's header start
    nxt = render_chat(tok, CHAT + [{"role": "assistant", "content": "6", "reasoning_content": "Add."},
                                   {"role": "user", "content": "Thanks"}], [])
    assert nxt.ids[:p.header_start] == p.ids[:p.header_start]


def test_no_header_start_without_a_generation_prompt(server):
    tok = server.tokenizer
    assert render_chat(tok, CHAT[:2], [], continue_final=True).header_start is None
    plain = Tokenizer(tok._tok, "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    assert render_chat(plain, CHAT, []).header_start is None  # the template adds nothing for the generation prompt
