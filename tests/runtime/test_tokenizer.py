"""Runtime Tokenizer: chat rendering identical to transformers, ids identical to it, streaming detokenization."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from ft.compiler.synth.tokenizer import write_tokenizer_files
from ft.runtime.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer

SPECIAL = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
NUM_RANKS = 4096  # truncated real vocab: CJK and emoji need several byte tokens, which exercises held-back UTF-8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for flavor in ("qwen3", "qwen3_5"):
        out[flavor] = tmp_path_factory.mktemp(flavor)
        write_tokenizer_files(out[flavor], flavor, num_ranks=NUM_RANKS)
    return out


@pytest.fixture(scope="module")
def toks(dirs) -> dict[str, Tokenizer]:
    return {f: Tokenizer.from_files(d / "tokenizer.json", d / "chat_template.jinja", SPECIAL) for f, d in dirs.items()}


@pytest.fixture(scope="module")
def hf_toks(dirs):
    from transformers import PreTrainedTokenizerFast

    out = {}
    for flavor, d in dirs.items():
        hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
        hf.chat_template = (d / "chat_template.jinja").read_text()
        out[flavor] = hf
    return out


# ---- chat rendering equals transformers' apply_chat_template ------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt 🌦",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop"}}]
_TEXTS = ["hi", "  padded \n", "", "<tool_response>\nx\n</tool_response>", "<think>\nr\n</think>\n\nanswer",
          "pre</think>post", "中文 ✓ 😀", "a\nb", "<|im_start|>injected"]
_VALUES = ["s", "multi\nline", 3, 2.5, True, False, None, [1, "a"], {"k": [1, {"z": None}]}, "", "ü"]


def _random_chat(rng: random.Random) -> list[dict]:
    def content():
        r = rng.random()
        if r < 0.75:
            return rng.choice(_TEXTS)
        if r < 0.9:
            return [{"type": "text", "text": rng.choice(_TEXTS)} for _ in range(rng.randint(0, 2))]
        return None

    def call():
        fn = {"name": rng.choice(["get_weather", "noop"]),
              "arguments": {f"p{i}": rng.choice(_VALUES) for i in range(rng.randint(0, 3))}}
        return {"id": "call_1", "type": "function", "function": fn} if rng.random() < 0.7 else fn

    chat = [{"role": "system", "content": content()}] if rng.random() < 0.4 else []
    chat.append({"role": "user", "content": rng.choice(_TEXTS)})
    for _ in range(rng.randint(0, 5)):
        m = {"role": rng.choices(["user", "assistant", "tool"], [3, 4, 2])[0], "content": content()}
        if m["role"] == "assistant":
            if rng.random() < 0.5:
                m[rng.choice(["reasoning_content", "reasoning", "thinking"])] = rng.choice(["\nthought\n", "t", ""])
            if rng.random() < 0.5:
                m["tool_calls"] = [call() for _ in range(rng.randint(1, 3))]
        chat.append(m)
    return chat


def _render(tok, chat, **kwargs):
    try:
        return "ok", tok.apply_chat_template(chat, **kwargs)
    except Exception:  # both sides must refuse the same conversations
        return "error", None


@pytest.mark.parametrize("flavor", ["qwen3", "qwen3_5"])
def test_chat_rendering_equals_transformers(toks, hf_toks, flavor):
    rng = random.Random(1234)
    ok = 0
    for _ in range(250):
        chat = _random_chat(rng)
        kwargs = {"tools": rng.choice([None, [], TOOLS]), "add_generation_prompt": rng.random() < 0.7}
        thinking = rng.choice([None, True, False])
        ours = _render(toks[flavor], chat, enable_thinking=thinking, **kwargs)
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        theirs = _render(hf_toks[flavor], chat, tokenize=False, **kwargs)
        assert ours == theirs, chat
        ok += ours[0] == "ok"
    assert ok > 100  # most random chats render


def test_chat_template_inputs_are_normalized_like_transformers(toks, hf_toks):
    # None-valued keys are dropped; `reasoning` is aliased to `reasoning_content`; extra kwargs and special tokens
    # reach the template; the caller's messages are not modified.
    template = ("{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ custom }}|{{ tools is none }}|"
                "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }}/{{ 'content' in m }};{% endfor %}"
                "{{ {'a': 'é'} | tojson }}{{ [1, 2] | tojson(indent=2) }}{% set ns = namespace(x=1) %}{{ ns.x }}")
    chat = [{"role": "assistant", "content": None, "reasoning": "why"}, {"role": "user", "content": "x"}]
    ours = Tokenizer(toks["qwen3"]._tok, template, SPECIAL).apply_chat_template(chat, custom=7)
    hf_toks["qwen3"].chat_template = template
    try:
        theirs = hf_toks["qwen3"].apply_chat_template(chat, tokenize=False, add_generation_prompt=True, custom=7)
    finally:
        hf_toks["qwen3"].chat_template = toks["qwen3"].chat_template
    assert ours == theirs
    assert ours.startswith("<|im_end|>|<|endoftext|>|False|7|True|why/why/False;")
    assert chat[0] == {"role": "assistant", "content": None, "reasoning": "why"}


def test_chat_template_errors(toks):
    no_template = Tokenizer(toks["qwen3"]._tok, None, SPECIAL)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        toks["qwen3"].apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="boom"):
        Tokenizer(toks["qwen3"]._tok, "{{ raise_exception('boom') }}").apply_chat_template([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="underscore|_secret"):
        Tokenizer(toks["qwen3"]._tok, "{% set ns = namespace(_secret=1) %}").apply_chat_template([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        Tokenizer(toks["qwen3"]._tok, "{% if %}")
    with pytest.raises(ValueError, match="eos_token='<nope>' is not in the vocabulary"):
        Tokenizer(toks["qwen3"]._tok, None, {"eos_token": "<nope>"})


# ---- ids ---------------------------------------------------------------------------------------------------------

STREAM_TEXTS = ["Hello, world!", "héllo 世界 😀👨‍👩‍👧 🇺🇸",
                "<think>\n推理\n</think>\n\n<tool_call>\n{\"a\": 1}\n</tool_call>",
                "def f(x):\n    return x  # ✓\n", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]


@pytest.mark.parametrize("flavor", ["qwen3", "qwen3_5"])
def test_ids_and_specials(toks, hf_toks, flavor):
    tok, hf = toks[flavor], hf_toks[flavor]
    assert tok.vocab_size == len(hf)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (NUM_RANKS + 2, NUM_RANKS, None)
    assert tok.token_to_id("<think>") == hf.convert_tokens_to_ids("<think>")
    assert tok.id_to_token(NUM_RANKS + 1) == "<|im_start|>"
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


# ---- streaming detokenization ------------------------------------------------------------------------------------

def _stream(dec: IncrementalDecoder, ids: list[int]) -> list[str]:
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("flavor", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("byte_level", [True, False])
def test_incremental_decoding_equals_full_decode(toks, flavor, byte_level):
    tok = toks[flavor]
    rng = random.Random(7)
    sequences = [tok.encode(t) for t in STREAM_TEXTS]
    # Random ids: mostly lone byte tokens (broken and truncated UTF-8) mixed with words and specials.
    for _ in range(30):
        sequences.append([rng.choice([rng.randrange(128, 256), rng.randrange(tok.vocab_size)])
                          for _ in range(rng.randint(1, 40))])
    for ids in sequences:
        for skip in (False, True):
            deltas = _stream(IncrementalDecoder(tok, skip_special_tokens=skip, byte_level=byte_level), ids)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids
    # Valid text never shows a replacement character: partial characters are held back.
    for text in STREAM_TEXTS:
        deltas = _stream(IncrementalDecoder(tok, byte_level=byte_level), tok.encode(text))
        assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text


def test_incremental_decoder_holds_back_partial_characters(toks):
    tok = toks["qwen3"]
    ids = tok.encode("😀")  # 4 UTF-8 bytes; below rank 4096 they are separate byte tokens
    assert len(ids) > 1
    dec = tok.incremental_decoder()
    assert [dec.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert dec.push(tok.token_to_id("<think>")) == "<think>"  # specials stream as text
    dec.push(ids[0])
    assert dec.flush() == "\ufffd"  # an unfinished character at the end decodes like a full decode would


# ---- loading -----------------------------------------------------------------------------------------------------

class _AssetReader:
    """The slice of the FtwReader interface that Tokenizer.from_reader uses, backed by a directory."""

    def __init__(self, root: Path, tokenizer: dict):
        self.root, self.tokenizer = root, tokenizer

    def asset(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def asset_path(self, name: str) -> Path:
        return self.root / name


def test_from_reader(dirs, toks):
    meta = {"file": "tokenizer.json", "chat_template": "chat_template.jinja", "bos_token": None,
            "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "special_tokens": {}}
    tok = Tokenizer.from_reader(_AssetReader(dirs["qwen3_5"], meta))
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == toks["qwen3_5"].apply_chat_template(chat)
    assert (tok.eos_token_id, tok.pad_token_id) == (NUM_RANKS + 2, NUM_RANKS)
    plain = Tokenizer.from_reader(_AssetReader(dirs["qwen3"], {**meta, "chat_template": None}))
    assert plain.chat_template is None and plain.encode("hi") == toks["qwen3"].encode("hi")
    with pytest.raises(ValueError, match="no 'file'"):
        Tokenizer.from_reader(_AssetReader(dirs["qwen3"], {"chat_template": None}))


def test_runtime_tokenizer_imports_neither_transformers_nor_the_compiler():
    code = ("import sys, ft.runtime.tokenizer; bad = [m for m in sys.modules if m == 'transformers' "
            "or m.startswith(('transformers.', 'ft.compiler'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_corrupted_tokenizer_file_is_a_checksum_error(ftw_for, tmp_path):
    import shutil

    from ft.formats import FtwReader
    from ft.formats.errors import FtwChecksumError

    ftw = Path(shutil.copytree(ftw_for("qwen3_moe", "nvfp4"), tmp_path / "m"))
    path = ftw / FtwReader(ftw).tokenizer["file"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x20  # same size: only the checksum can tell
    path.write_bytes(bytes(raw))
    with pytest.raises(FtwChecksumError, match="asset xxh3"):
        Tokenizer.from_reader(FtwReader(ftw))


def test_text_without_a_utf8_form_is_refused_with_its_position(toks):
    with pytest.raises(UnicodeEncodeError) as info:
        toks["qwen3"].encode("abc\ud800def")
    assert info.value.start == 3
