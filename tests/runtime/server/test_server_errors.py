"""Every error case, with its status and each API's own error shape; auth; loading; limits."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from ft.runtime.server.app import load_engine
from ft.runtime.server.state import ServeSettings
from ft.runtime.settings import EngineSettings

CHAT = "/v1/chat/completions"
MSG = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def _openai_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param
    return err


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
def test_invalid_json_openai_shape(server, path):
    r = httpx.post(server.url + path, content=b"{not json", headers={"content-type": "application/json"})
    err = _openai_error(r, 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


def test_invalid_json_and_fields_anthropic_shape(server):
    r = httpx.post(server.url + MSG, content=b"[1,", headers={"content-type": "application/json"})
    assert "JSON" in _anthropic_error(r, 400, "invalid_request_error")
    r = httpx.post(server.url + MSG, json={"model": "tiny-qwen3", "messages": USER})  # max_tokens missing
    assert "max_tokens" in _anthropic_error(r, 400, "invalid_request_error")
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"messages": [{"role": "robot", "content": "x"}]})
    _anthropic_error(r, 400, "invalid_request_error")


@pytest.mark.parametrize("body,param", [
    ({"messages": USER, "temperature": 5}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "f", "arguments": "{oops"}}]}, *USER]}, "messages[0].tool_calls[0].function.arguments"),
    # strict types: no string or boolean coercion; integers within what the sampler takes
    ({"messages": USER, "max_tokens": "3"}, "max_tokens"),
    ({"messages": USER, "max_tokens": True}, "max_tokens"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "logprobs": 1}, "logprobs"),
    ({"messages": USER, "seed": 2**70}, "seed"),
])
def test_invalid_chat_fields(server, body, param):
    _openai_error(httpx.post(server.url + CHAT, json=body), 400, param)


def test_strict_types_anthropic(server):
    for field, bad in (("max_tokens", {"max_tokens": "3"}), ("stream", {"max_tokens": 8, "stream": "yes"}),
                       ("temperature", {"max_tokens": 8, "temperature": "0.5"})):
        r = httpx.post(server.url + MSG, json={"messages": USER, **bad})
        assert _anthropic_error(r, 400, "invalid_request_error").startswith(f"{field}:")


def _post_ascii(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    """JSON with every non-ASCII character escaped, as a client sends a lone surrogate (\\ud800)."""
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def test_lone_surrogate_is_a_400_and_the_connection_lives_on(server):
    text = "\ud800abc"  # valid JSON, no UTF-8 form
    with httpx.Client(base_url=server.url) as client:  # one keep-alive connection for every request
        for path, body in ((CHAT, {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
                           ("/v1/completions", {"prompt": text, "max_tokens": 2}),
                           ("/v1/responses", {"input": text, "max_output_tokens": 2})):
            err = _openai_error(_post_ascii(client, path, body), 400)
            assert err["code"] == "invalid_unicode" and "\\ud800" in err["message"]
        message = _anthropic_error(_post_ascii(client, MSG, {"messages": [{"role": "user", "content": text}],
                                                             "max_tokens": 2}), 400, "invalid_request_error")
        assert "not valid Unicode" in message
        assert client.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_openapi_schema_needs_the_key(server, tight_server):
    assert httpx.get(server.url + "/openapi.json").json()["info"]["title"] == "ft"
    assert httpx.get(tight_server.url + "/openapi.json").status_code == 401
    r = httpx.get(tight_server.url + "/openapi.json", headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


def test_invalid_completion_fields(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1})
    assert "echo" in _openai_error(r, 400, "logprobs")["message"]
    _openai_error(httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"]}), 400, "prompt")
    _openai_error(httpx.post(server.url + "/v1/completions", json={"prompt": [10**9]}), 400)


def test_unknown_model_and_route(server):
    err = _openai_error(httpx.post(server.url + CHAT, json={"model": "gpt-9", "messages": USER}), 404, "model")
    assert err["code"] == "model_not_found" and "tiny-qwen3" in err["message"]
    r = httpx.post(server.url + MSG, json={"model": "claude-x", "max_tokens": 4, "messages": USER})
    assert "tiny-qwen3" in _anthropic_error(r, 404, "not_found_error")
    _openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert httpx.get(server.url + CHAT).status_code == 405


def test_auth(tight_server):
    url = tight_server.url
    assert httpx.get(url + "/health").status_code == 200  # exempt
    assert _openai_error(httpx.post(url + CHAT, json={"messages": USER}), 401)["code"] == "invalid_api_key"
    _openai_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    _openai_error(httpx.get(url + "/v1/stats"), 401)
    _openai_error(httpx.get(url + "/metrics"), 401)
    _anthropic_error(httpx.post(url + MSG, json={"max_tokens": 2, "messages": USER}, headers={"x-api-key": "no"}),
                     401, "authentication_error")
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "secret"}).status_code == 200


def test_context_overflow_names_length_budget_and_flag(tight_server):
    long_text = "word " * 600
    r = httpx.post(tight_server.url + CHAT, json={"messages": [{"role": "user", "content": long_text}]},
                   headers=tight_server.headers)
    err = _openai_error(r, 400)
    n = len(tight_server.tokenizer.encode(tight_server.tokenizer.apply_chat_template(
        [{"role": "user", "content": long_text}])))
    assert err["code"] == "context_length_exceeded"
    assert f"prompt is {n} tokens" in err["message"] and "400" in err["message"]
    assert "--kv-reserve-tokens" in err["message"]
    r = httpx.post(tight_server.url + MSG, json={"max_tokens": 4, "messages": [{"role": "user", "content": long_text}]},
                   headers=tight_server.headers)
    assert "--kv-reserve-tokens" in _anthropic_error(r, 400, "invalid_request_error")


def test_max_tokens_is_clamped(tight_server):
    r = httpx.post(tight_server.url + "/v1/completions", headers=tight_server.headers,
                   json={"prompt": "Hello", "max_tokens": 500, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"


def test_full_queue_is_429_for_openai_and_529_for_anthropic(qwen3_ftw, make_server):
    live = make_server(ServeSettings(ftw=qwen3_ftw, port=0,
                                     engine=EngineSettings(max_running_requests=1, max_queued_requests=1)))
    body = {"messages": USER, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as client:
        with client.stream("POST", CHAT, json=body) as running, client.stream("POST", CHAT, json=body) as queued:
            lines = running.iter_lines()  # keep the iterator: dropping it would close the stream
            next(lines)
            assert running.status_code == queued.status_code == 200
            err = _openai_error(client.post(CHAT, json=body), 429)
            assert err["type"] == "rate_limit_error" and "busy" in err["message"]
            r = client.post(MSG, json={"max_tokens": 4, "messages": USER})
            _anthropic_error(r, 529, "overloaded_error")
            assert r.headers["retry-after"] == "1"
    stats = live.wait_idle()
    assert stats["requests"]["rejected"] == 2 and stats["requests"]["disconnected"] == 2


def _wait_health(live, leave: int) -> httpx.Response:
    for _ in range(400):
        r = httpx.get(live.url + "/health")
        if r.status_code != leave:
            return r
        threading.Event().wait(0.05)
    raise AssertionError(f"/health stayed {leave}")


def test_health_while_loading_then_ok(qwen3_ftw, make_server):
    gate = threading.Event()
    settings = ServeSettings(ftw=qwen3_ftw, port=0)
    live = make_server(settings, load=lambda: gate.wait(30) and load_engine(settings), wait_loaded=False)
    r = httpx.get(live.url + "/health")
    assert (r.status_code, r.json()) == (503, {"status": "loading"})
    assert _openai_error(httpx.post(live.url + CHAT, json={"messages": USER}), 503)["code"] == "model_loading"
    _anthropic_error(httpx.post(live.url + MSG, json={"max_tokens": 2, "messages": USER}), 503, "api_error")
    assert httpx.get(live.url + "/v1/stats").json()["status"] == "loading"
    gate.set()
    r = _wait_health(live, 503)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_load_failure_is_reported(tmp_path, make_server):
    live = make_server(ServeSettings(ftw=tmp_path, port=0), wait_loaded=False)
    r = _wait_health(live, 503)
    assert r.status_code == 500 and r.json()["status"] == "error" and r.json()["error"]
    assert "unavailable" in _openai_error(httpx.post(live.url + CHAT, json={"messages": USER}), 500)["message"]


@pytest.mark.parametrize("kwargs,flag", [({"api_key": ""}, "--api-key"), ({"port": 70000}, "--port")])
def test_serve_settings_validation(tmp_path, kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServeSettings(ftw=tmp_path, **kwargs)


def test_engine_failure_is_an_error_not_a_disconnect(qwen3_ftw, make_server):
    """A forward that raises (a corrupted expert record, say) ends every request with a server error; the stats
    count those as errors, one per request, never as clients that went away."""
    def broken():
        engine = load_engine(settings)
        engine.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad expert record"))
        return engine

    settings = ServeSettings(ftw=qwen3_ftw, engine=EngineSettings(device="cpu"), port=0)
    live = make_server(settings, broken)
    _openai_error(httpx.post(live.url + CHAT, json={"messages": USER, "max_tokens": 2}), 500)
    with httpx.stream("POST", live.url + CHAT, json={"messages": USER, "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and '"error"' in r.read().decode()
    with httpx.stream("POST", live.url + MSG, json={"messages": USER, "max_tokens": 2, "stream": True}) as r:
        assert "event: error" in r.read().decode()
    requests = httpx.get(live.url + "/v1/stats").json()["requests"]
    assert (requests["errors"], requests["disconnected"], requests["completed"]) == (3, 0, 0)
    health = httpx.get(live.url + "/health")
    assert health.status_code == 500 and "bad expert record" in health.json()["error"]


def test_oversized_bodies_are_413_before_parsing(qwen3_ftw, make_server):
    live = make_server(ServeSettings(ftw=qwen3_ftw, engine=EngineSettings(device="cpu"), port=0,
                                     max_request_bytes=4096))
    big = {"messages": [{"role": "user", "content": "x" * 8000}], "max_tokens": 1}
    err = _openai_error(httpx.post(live.url + CHAT, json=big), 413)
    assert err["code"] == "request_too_large" and "4096 bytes" in err["message"]
    _anthropic_error(httpx.post(live.url + MSG, json=big), 413, "request_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    _openai_error(httpx.post(live.url + CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert httpx.post(live.url + CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200
    assert httpx.get(live.url + "/health").status_code == 200
    with pytest.raises(ValueError, match="--max-request-bytes"):
        ServeSettings(ftw=qwen3_ftw, max_request_bytes=10)


def test_a_data_file_truncated_while_serving_is_an_error_not_a_crash(qwen3_ftw, make_server, tmp_path):
    """Reading a truncated mapping kills the process (SIGBUS): the engine checks its files before each step, so a
    request gets a clean 500 naming the file, /health reports it, and the process lives on."""
    import shutil

    ftw = Path(shutil.copytree(qwen3_ftw, tmp_path / "m"))
    live = make_server(ServeSettings(ftw=ftw, engine=EngineSettings(device="cpu"), port=0))
    assert httpx.post(live.url + CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200
    data = sorted(ftw.glob("data-*.ftd"))[0]
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    err = _openai_error(httpx.post(live.url + CHAT, json={"messages": USER, "max_tokens": 2}), 500)
    assert data.name in err["message"] and "changed on disk" in err["message"]
    health = httpx.get(live.url + "/health")
    assert health.status_code == 500 and "restart the server" in health.json()["error"]


def test_max_tokens_past_the_context_window_is_a_400_naming_both_numbers(server):
    """An explicit max_tokens that the context cannot hold after the prompt is refused, never silently lowered
    (without one, the output is bounded by what the context leaves: test_engine_preemption.py)."""
    window = server.state.loop.engine.max_context
    with httpx.Client(base_url=server.url, timeout=30) as client:
        err = _openai_error(client.post(CHAT, json={"messages": USER, "max_tokens": window}), 400, "messages")
        assert err["code"] == "context_length_exceeded"
        assert f"max_tokens ({window})" in err["message"] and f"context window of {window} tokens" in err["message"]
        r = client.post(MSG, json={"max_tokens": window, "messages": USER})
        assert r.status_code == 400 and f"context window of {window} tokens" in r.json()["error"]["message"]
        ok = client.post(CHAT, json={"messages": USER, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
