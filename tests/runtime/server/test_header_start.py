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


def test_the_next_turn_resumes_at_the_previous_header_through_the_api(think_server):
    """Hybrid model (Gated DeltaNet), thinking template: the next turn's history drops the reply's thinking, so it
    diverges right after the previous assistant header. The server passed the header start as a snapshot position,
    so the second request reuses exactly the first prompt up to it (without it: nothing, as the prompt end's state
    includes the `<think>` the new history lacks)."""
    import httpx

    url = think_server.url + "/v1/chat/completions"
    turn = [{"role": "user", "content": "Name a color."}]
    body = {"model": think_server.state.model_name, "max_tokens": 4, "temperature": 0}
    assert httpx.post(url, json={**body, "messages": turn}, timeout=120).status_code == 200
    # the client sends the reply back (fixed text here: the tiny random model's own may hold control-token text)
    nxt = turn + [{"role": "assistant", "content": "Red.", "reasoning_content": "A color."},
                  {"role": "user", "content": "Another one?"}]
    second = httpx.post(url, json={**body, "messages": nxt}, timeout=120).json()
    assert "usage" in second, second
    header = render_chat(think_server.tokenizer, turn, []).header_start
    assert header and second["usage"]["prompt_tokens_details"]["cached_tokens"] == header
