"""Server-side counters: GET /v1/stats (JSON) and GET /metrics (Prometheus text format 0.0.4).

HTTP handlers record request starts/ends (event-loop thread); the engine loop reports generated tokens (engine
thread); one lock guards both. Engine figures (KV use, running/waiting, its own tok/s and TTFT, "moe" counters when the
engine has an expert cache) come from the loop's snapshot of engine.stats().
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any


def _summary(values: list[float]) -> dict[str, float | None]:
    """mean / p50 / p95 in milliseconds over a window of seconds."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None}
    ordered = sorted(values)
    pick = lambda q: round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)  # noqa: E731
    return {"count": len(ordered), "mean": round(1000 * sum(ordered) / len(ordered), 3), "p50": pick(0.5),
            "p95": pick(0.95)}


class ServerMetrics:
    WINDOW_S = 10.0  # throughput window

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.by_endpoint: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.response_formats: Counter[str] = Counter()
        self.active = 0
        self.completed = 0
        self.disconnected = 0
        self.rejected = 0  # queue full
        self.errors = 0  # 4xx/5xx answers
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.generated_tokens = 0  # every token the engine produced (incl. requests cut off by a disconnect)
        self._ttft: deque[float] = deque(maxlen=1024)
        self._latency: deque[float] = deque(maxlen=1024)
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens) for the window

    # ---- recording ------------------------------------------------------------------------------------------

    def request_started(self, endpoint: str) -> None:
        with self._lock:
            self.by_endpoint[endpoint] += 1
            self.active += 1

    def request_ended(self, *, prompt_tokens: int, completion_tokens: int, finish_reason: str | None,
                      ttft_s: float | None, latency_s: float, failed: bool = False) -> None:
        """`failed`: the engine failed under the request; its error answer is counted by `error()`."""
        with self._lock:
            self.active -= 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if failed:
                pass
            elif finish_reason in (None, "abort"):
                self.disconnected += 1
            else:
                self.completed += 1
                self.finish_reasons[finish_reason] += 1
                self._latency.append(latency_s)
            if ttft_s is not None:
                self._ttft.append(ttft_s)

    def rejected_request(self) -> None:
        with self._lock:
            self.rejected += 1

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def response_format(self, kind: str) -> None:
        with self._lock:
            self.response_formats[kind] += 1

    def on_engine_events(self, events: list) -> None:
        """Engine thread: count produced tokens for the throughput window."""
        n = sum(1 for ev in events if ev.token_id is not None)
        if not n:
            return
        now = time.monotonic()
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.WINDOW_S:
            self._recent.popleft()

    # ---- reports --------------------------------------------------------------------------------------------

    def snapshot(self, *, model: str, status: str, engine_stats: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            window_tokens = sum(n for _, n in self._recent)
            uptime = time.time() - self.started
            out: dict[str, Any] = {
                "model": model,
                "status": status,
                "uptime_s": round(uptime, 3),
                "requests": {"active": self.active, "completed": self.completed, "disconnected": self.disconnected,
                             "rejected": self.rejected, "errors": self.errors, "by_endpoint": dict(self.by_endpoint),
                             "finish_reasons": dict(self.finish_reasons)},
                "tokens": {"prompt_total": self.prompt_tokens, "completion_total": self.completion_tokens,
                           "generated_total": self.generated_tokens},
                "throughput": {"window_s": self.WINDOW_S,
                               "tok_s": round(window_tokens / max(min(self.WINDOW_S, uptime), 1e-3), 3),
                               "engine_decode_tok_s": engine_stats.get("decode_tok_s"),
                               "engine_prefill_tok_s": engine_stats.get("prefill_tok_s")},
                "ttft_ms": _summary(list(self._ttft)),
                "latency_ms": _summary(list(self._latency)),
                "response_format": dict(self.response_formats),
            }
        used, total = engine_stats.get("kv_tokens_used"), engine_stats.get("kv_tokens_total")
        out["kv"] = {"used_tokens": used, "total_tokens": total, "cached_tokens": engine_stats.get("kv_tokens_cached"),
                     "utilization": round(used / total, 4) if used is not None and total else None}
        out["scheduler"] = {"running": engine_stats.get("running"), "waiting": engine_stats.get("waiting"),
                            "preemptions": engine_stats.get("preemptions")}
        out["engine"] = {k: v for k, v in engine_stats.items() if k not in ("moe", "prefix_cache")}
        out["moe"] = engine_stats.get("moe")  # None: this engine has no expert cache (CPU experts)
        out["prefix_cache"] = engine_stats.get("prefix_cache")  # None: turned off (--prefix-cache-entries 0)
        return out


def prometheus_text(stats: dict[str, Any]) -> str:
    """The stats snapshot as Prometheus exposition text (gauges and counters, `ft_` prefix)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: Any, labels: dict[str, str] | None = None,
               header: bool = True) -> None:
        if header:
            lines.append(f"# HELP ft_{name} {help_text}")
            lines.append(f"# TYPE ft_{name} {kind}")
        if value is None:
            return
        label = "" if not labels else "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"
        lines.append(f"ft_{name}{label} {float(value):g}")

    req, tok = stats["requests"], stats["tokens"]
    metric("up", "gauge", "1 when the engine is loaded", 1 if stats["status"] == "ok" else 0,
           {"model": stats["model"]})
    metric("uptime_seconds", "gauge", "Seconds since the server started", stats["uptime_s"])
    metric("requests_active", "gauge", "Requests being served", req["active"])
    metric("requests_completed_total", "counter", "Requests that finished normally", req["completed"])
    metric("requests_disconnected_total", "counter", "Requests whose client went away", req["disconnected"])
    metric("requests_rejected_total", "counter", "Requests refused because the queue was full", req["rejected"])
    metric("request_errors_total", "counter", "Error answers (4xx/5xx)", req["errors"])
    first = True
    for endpoint, n in sorted(req["by_endpoint"].items()):
        metric("requests_total", "counter", "Requests started, by endpoint", n, {"endpoint": endpoint}, first)
        first = False
    metric("prompt_tokens_total", "counter", "Prompt tokens of served requests", tok["prompt_total"])
    metric("completion_tokens_total", "counter", "Completion tokens of served requests", tok["completion_total"])
    metric("generated_tokens_total", "counter", "Tokens produced by the engine", tok["generated_total"])
    metric("generation_tokens_per_second", "gauge", "Tokens per second over the last window",
           stats["throughput"]["tok_s"])
    for key in ("mean", "p50", "p95"):
        metric(f"ttft_{key}_ms", "gauge", f"Time to first token, {key}, milliseconds", stats["ttft_ms"][key])
    kv = stats["kv"]
    metric("kv_used_tokens", "gauge", "KV tokens reserved by running requests", kv["used_tokens"])
    metric("kv_total_tokens", "gauge", "KV token budget", kv["total_tokens"])
    metric("running_requests", "gauge", "Requests in the running batch", stats["scheduler"]["running"])
    metric("waiting_requests", "gauge", "Requests waiting for admission", stats["scheduler"]["waiting"])
    metric("preemptions_total", "counter", "Running requests preempted for KV (recomputed later)",
           stats["scheduler"].get("preemptions"))
    for key, value in sorted(_flatten(stats.get("moe") or {}).items()):
        metric(f"moe_{key}", "gauge", f"Expert cache figure {key}", value)
    for key, value in sorted(_flatten(stats.get("prefix_cache") or {}).items()):
        metric(f"prefix_cache_{key}", "gauge", f"Prefix cache figure {key}", value)
    return "\n".join(lines) + "\n"


def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict, keys joined with '_' (booleans and strings skipped)."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}".replace(".", "_").replace("-", "_")
        if isinstance(v, dict):
            out.update(_flatten(v, key + "_"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
