"""`ft launch` against a live server: each tool's config in its documented shape with the served model's numbers,
cloud keys removed, clear refusals; and a real launch of a stand-in tool that records what it was given.

The schemas below hold what each project documents for a custom OpenAI-compatible provider (the keys `ft launch`
relies on, their types and nesting): opencode.ai/config.json's provider entries, charm.land/crush.json's providers
and model picks, pi's models.json (docs/models.md), Codex's config.toml model provider table (wire_api "responses":
the only wire API Codex still speaks)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tomllib

import jsonschema
import pytest
from typer.testing import CliRunner

from ft.cli.main import app

runner = CliRunner()
INT, STR, BOOL = {"type": "integer", "minimum": 1}, {"type": "string", "minLength": 1}, {"type": "boolean"}


def _obj(required: dict, **extra) -> dict:
    return {"type": "object", "required": list(required), "properties": required, **extra}


OPENCODE = _obj({
    "$schema": {"const": "https://opencode.ai/config.json"}, "model": STR,
    "provider": {"type": "object", "additionalProperties": _obj({
        "npm": {"const": "@ai-sdk/openai-compatible"},
        "options": _obj({"baseURL": {"type": "string", "pattern": "/v1$"}, "apiKey": STR}),
        "models": {"type": "object", "minProperties": 1, "additionalProperties": _obj({
            "limit": _obj({"context": INT, "output": INT})})}})}})
CRUSH = _obj({
    "$schema": {"const": "https://charm.land/crush.json"},
    "providers": {"type": "object", "additionalProperties": _obj({
        "type": {"enum": ["openai", "openai-compat", "anthropic"]}, "base_url": STR, "api_key": STR,
        "models": {"type": "array", "minItems": 1, "items": _obj({
            "id": STR, "name": STR, "context_window": INT, "default_max_tokens": INT, "can_reason": BOOL,
            "supports_attachments": BOOL})}})},
    "models": _obj({"large": _obj({"model": STR, "provider": STR}), "small": _obj({"model": STR, "provider": STR})})})
PI = _obj({"providers": {"type": "object", "additionalProperties": _obj({
    "baseUrl": STR, "api": {"enum": ["openai-completions", "openai-responses", "anthropic-messages"]}, "apiKey": STR,
    "models": {"type": "array", "minItems": 1, "items": _obj({
        "id": STR, "contextWindow": INT, "maxTokens": INT, "reasoning": BOOL,
        "input": {"type": "array", "items": {"enum": ["text", "image"]}}})}})}})


def _launch(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["launch", *args])
    return result.exit_code, result.output


def _dry(tool: str, server, *extra: str) -> dict:
    code, out = _launch(tool, "--url", server.url, "--dry-run", *extra)
    assert code == 0, out
    return json.loads(out)


def _card(server) -> dict:
    import urllib.request

    with urllib.request.urlopen(server.url + "/v1/models") as resp:
        return json.loads(resp.read())["data"][0]


def test_each_tool_gets_its_documented_config_with_the_served_numbers(server, tmp_path):
    card = _card(server)
    model, context = card["id"], card["context_length"]
    output = min(card["max_output_tokens"], context // 2)
    assert isinstance(card["capabilities"]["reasoning"], bool)
    for tool, schema, name in (("opencode", OPENCODE, "opencode.json"), ("crush", CRUSH, "crush.json"),
                               ("pi", PI, "models.json")):
        plan = _dry(tool, server, "--dir", str(tmp_path))
        (path, text), = plan["files"].items()
        assert path.endswith(name) and path.startswith(str(tmp_path))
        doc = json.loads(text)
        jsonschema.validate(doc, schema)
        assert server.url + "/v1" in text and str(context) in text and str(output) in text and model in text
        assert "OPENAI_API_KEY" in plan["unset"] and "ANTHROPIC_API_KEY" in plan["unset"]
        assert not (tmp_path / tool).exists()  # a dry run writes nothing
    assert _dry("opencode", server)["env"]["OPENCODE_CONFIG"].endswith("opencode.json")
    pi = _dry("pi", server, "--", "-p", "hello")
    assert pi["command"] == ["pi", "--provider", "ft", "--model", model, "-p", "hello"]

    claude = _dry("claude", server)
    env = claude["env"]
    assert env["ANTHROPIC_BASE_URL"] == server.url and env["ANTHROPIC_MODEL"] == model  # the host: Claude adds /v1
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(context) and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(output)
    assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == model and "ANTHROPIC_API_KEY" in claude["unset"]
    assert claude["command"] == ["claude"] and not claude["files"]

    codex = _dry("codex", server, "--", "exec", "hi")
    argv = codex["command"]
    assert argv[0] == "codex" and argv[-2:] == ["exec", "hi"]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    conf: dict = {}
    for o in overrides:  # each value is TOML, as codex parses `-c key=value`
        key, value = o.split("=", 1)
        node = conf
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = tomllib.loads(f"v = {value}")["v"]
    assert conf["model"] == model and conf["model_context_window"] == context and conf["model_provider"] == "ft"
    provider = conf["model_providers"]["ft"]
    assert provider["wire_api"] == "responses" and provider["base_url"] == server.url + "/v1"
    assert codex["env"][provider["env_key"]]


def test_launch_refuses_clearly(server, tight_server, tmp_path, monkeypatch):
    code, out = _launch("emacs", "--url", server.url, "--dry-run")
    assert code == 1 and "unknown tool 'emacs'" in out and "claude, codex, opencode, crush, pi" in out
    code, out = _launch("crush", "--url", "http://127.0.0.1:9", "--timeout", "2", "--dry-run")
    assert code == 1 and "is `ft serve` running there?" in out
    code, out = _launch("crush", "--url", tight_server.url, "--dry-run")
    assert code == 1 and "401" in out
    plan = _dry("crush", tight_server, "--api-key", "secret")
    assert json.loads(next(iter(plan["files"].values())))["providers"]["ft"]["api_key"] == "secret"
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing installed
    code, out = _launch("crush", "--url", server.url, "--dir", str(tmp_path / "cfg"))
    assert code == 1 and "'crush' is not installed" in out and not (tmp_path / "cfg").exists()


def test_launch_starts_the_tool_with_its_config_and_without_cloud_keys(server, tmp_path):
    bin_dir, record = tmp_path / "bin", tmp_path / "record.json"
    bin_dir.mkdir()
    tool = bin_dir / "crush"  # a stand-in that records its arguments, environment and config
    tool.write_text(f"#!{sys.executable}\nimport json, os, sys, pathlib\n"
                    "cfg = pathlib.Path(os.environ['CRUSH_GLOBAL_CONFIG'], 'crush.json').read_text()\n"
                    f"pathlib.Path({str(record)!r}).write_text(json.dumps("
                    "{'argv': sys.argv[1:], 'env': dict(os.environ), 'config': json.loads(cfg)}))\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OPENAI_API_KEY": "sk-cloud",
           "ANTHROPIC_API_KEY": "sk-ant-cloud", "KEEP_ME": "1"}
    cmd = [sys.executable, "-c", "from ft.cli.main import main; main()", "launch", "crush", "--url", server.url,
           "--dir", str(tmp_path / "cfg"), "--", "run", "hello"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(record.read_text())
    assert got["argv"] == ["run", "hello"]
    assert "OPENAI_API_KEY" not in got["env"] and "ANTHROPIC_API_KEY" not in got["env"] and got["env"]["KEEP_ME"] == "1"
    assert got["config"]["providers"]["ft"]["base_url"] == server.url + "/v1"
    assert got["config"]["models"]["large"] == {"model": _card(server)["id"], "provider": "ft"}


@pytest.mark.parametrize("tool", ["claude", "codex", "opencode", "crush", "pi"])
def test_dry_run_is_plain_json(server, tool):
    plan = _dry(tool, server)
    assert set(plan) == {"tool", "command", "env", "unset", "files"} and plan["tool"] == tool
