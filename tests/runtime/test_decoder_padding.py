"""Streaming detokenization of ids past the tokenizer: the embedding's padding rows (Qwen3.5/3.6: 248,320 rows for
248,077 tokens) can be sampled, and must add no text (as `Tokenizer.decode` does) instead of failing the step."""

from __future__ import annotations

import pytest

from ft.compiler.synth.tokenizer import write_tokenizer_files
from ft.runtime.tokenizer import IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("qwen3_5")
    write_tokenizer_files(d, "qwen3_5", num_ranks=512)
    return Tokenizer.from_files(d / "tokenizer.json", None, {"eos_token": "<|im_end|>"})


@pytest.mark.parametrize("byte_level", [True, False])
def test_padding_ids_add_no_text(tok, byte_level):
    pad = [tok.vocab_size, tok.vocab_size + 200]
    ids = tok.encode("héllo") + pad[:1] + tok.encode(" wörld") + pad[1:]
    dec = IncrementalDecoder(tok, byte_level=byte_level)
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == tok.decode(ids) == "héllo wörld"
    assert all(dec.push(i) == "" for i in pad)
