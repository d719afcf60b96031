"""`ft generate`: greedy equals the engine, --json schema, --chat, streamed text, clear load errors."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from ft.cli.main import app
from ft.formats.layout import INDEX_NAME, Header
from ft.formats.reader import read_index
from ft.runtime.engine import Engine, generate
from ft.runtime.sampling import params_from_generation_config

PROMPT_IDS = [15, 99, 42, 7, 180, 3, 64]


@pytest.fixture(scope="module")
def ftw(ftw_for):
    return ftw_for("qwen3_moe")


def _invoke(*args: str):
    return CliRunner().invoke(app, ["generate", *args])


def test_token_ids_greedy_json_equals_engine_generate(ftw):
    res = _invoke("--ftw", str(ftw), "--token-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", "8",
                  "--temperature", "0", "--ignore-eos", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"prompt_token_ids", "token_ids", "text", "finish_reason", "prompt_tokens",
                        "output_tokens", "timings"}
    assert set(out["timings"]) == {"prefill_s", "ttft_s", "decode_s", "prefill_tok_s", "decode_tok_s"}
    assert all(isinstance(v, float) and v >= 0 for v in out["timings"].values())
    engine = Engine(ftw)
    # Unset knobs come from the model's generation_config, as in the server.
    params = params_from_generation_config(engine.generation_config, max_tokens=8, temperature=0, ignore_eos=True)
    ref = generate(engine, PROMPT_IDS, params)
    assert out["prompt_token_ids"] == PROMPT_IDS and out["prompt_tokens"] == len(PROMPT_IDS)
    assert out["token_ids"] == ref.token_ids and out["output_tokens"] == 8
    assert out["text"] == ref.text and out["finish_reason"] == "length"


def test_streamed_text_and_seeded_sampling(ftw):
    args = ["--ftw", str(ftw), "--prompt", "Hello there", "--max-tokens", "6", "--seed", "3", "--temperature",
            "0.8", "--ignore-eos"]
    first = _invoke(*args, "--json")
    assert first.exit_code == 0, first.output
    assert json.loads(_invoke(*args, "--json").stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    plain = _invoke(*args)
    assert plain.exit_code == 0, plain.output
    assert plain.stdout == json.loads(first.stdout)["text"] + "\n"
    assert "tok/s" in plain.stderr and "[length]" in plain.stderr


def test_chat_applies_the_chat_template(ftw):
    res = _invoke("--ftw", str(ftw), "--chat", "Hi!", "--max-tokens", "2", "--temperature", "0", "--json")
    assert res.exit_code == 0, res.output
    tok = Engine(ftw).tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True)
    assert "Hi!" in text and text != "Hi!"
    assert json.loads(res.stdout)["prompt_token_ids"] == tok.encode(text)


@pytest.mark.parametrize("args, msg", [
    ([], "give exactly one of --prompt, --chat or --token-ids"),
    (["--prompt", "a", "--token-ids", "1"], "give exactly one of"),
    (["--token-ids", "1,x"], "--token-ids must be comma-separated integers"),
    (["--token-ids", ",".join(["5"] * 40), "--kv-reserve-tokens", "16"],
     "prompt is 40 tokens; the KV budget is 16; raise --kv-reserve-tokens"),
])
def test_bad_arguments_fail_with_one_line(ftw, args, msg):
    res = _invoke("--ftw", str(ftw), *args)
    assert res.exit_code == 1
    assert res.stderr.startswith("error: ") and msg in res.stderr and res.stderr.count("\n") == 1


def _copy_with_manifest(src, dst, edit):
    shutil.copytree(src, dst)
    manifest = read_index(dst)
    edit(manifest)
    body = json.dumps(manifest, separators=(",", ":")).encode()
    (dst / INDEX_NAME).write_bytes(Header.for_manifest(body).pack() + body)
    return dst


def test_load_errors_are_one_clear_line(ftw, tmp_path):
    missing = _invoke("--ftw", str(tmp_path / "nope"), "--token-ids", "1")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: ") and "nope" in missing.stderr
    assert missing.stderr.count("\n") == 1

    broken = tmp_path / "broken"
    shutil.copytree(ftw, broken)
    data = bytearray((broken / INDEX_NAME).read_bytes())
    data[:8] = b"NOTFTW!!"
    (broken / INDEX_NAME).write_bytes(bytes(data))
    res = _invoke("--ftw", str(broken), "--token-ids", "1")
    assert res.exit_code == 1 and res.stderr.startswith("error: ") and "magic" in res.stderr
    assert res.stderr.count("\n") == 1

    def unknown_family(m):
        m["config"]["family"] = "llama"

    odd = _copy_with_manifest(ftw, tmp_path / "odd", unknown_family)
    res = _invoke("--ftw", str(odd), "--token-ids", "1")
    assert res.exit_code == 1 and res.stderr.startswith("error: ")
    assert "unknown family 'llama'" in res.stderr and res.stderr.count("\n") == 1
