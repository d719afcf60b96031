"""`ft ctl health|stats|cache`: query a running `ft serve` over HTTP and print the answer readably (or --json)."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

ctl = typer.Typer(name="ctl", help="Query a running `ft serve`: health, stats, expert cache.", no_args_is_help=True)

URL = typer.Option("http://127.0.0.1:1919", "--url", envvar="FT_URL", help="Server base URL.")
API_KEY = typer.Option(None, "--api-key", envvar="FT_API_KEY", help="API key, if the server requires one.")
AS_JSON = typer.Option(False, "--json", help="Print the raw JSON answer.")
TIMEOUT = typer.Option(10.0, "--timeout", help="Seconds to wait for the server.")


def register(app: typer.Typer) -> None:
    app.add_typer(ctl)


class CtlError(Exception):
    pass


def fetch(url: str, path: str, api_key: str | None, timeout: float) -> tuple[int, dict]:
    """GET url+path -> (status, JSON body); connection problems raise CtlError with a hint."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + path, headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read() or b"{}")
        except ValueError:
            body = {}
        if e.code == 401:
            raise CtlError(f"{url} refused the API key (401): pass --api-key or set FT_API_KEY") from None
        if path == "/health":
            return e.code, body
        message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
        raise CtlError(f"{url}{path} answered {e.code}: {message or body or e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CtlError(f"cannot reach {url}: {reason} (is `ft serve` running there?)") from None


def _get(url: str, path: str, api_key: str | None, timeout: float) -> tuple[int, dict]:
    from rich.console import Console

    try:
        return fetch(url, path, api_key, timeout)
    except CtlError as e:
        Console(stderr=True, soft_wrap=True).print(f"[red]error[/red]: {e}")
        raise typer.Exit(1)


@ctl.command("health")
def health(url: str = URL, api_key: Optional[str] = API_KEY, as_json: bool = AS_JSON,
           timeout: float = TIMEOUT) -> None:
    """Is the server up and the model loaded? Exit 0 when ready, 1 otherwise."""
    from rich.console import Console

    status, body = _get(url, "/health", api_key, timeout)
    if as_json:
        typer.echo(json.dumps(body))
    else:
        state = body.get("status", f"HTTP {status}")
        color = {"ok": "green", "loading": "yellow"}.get(state, "red")
        extra = f": {body['error']}" if body.get("error") else ""
        Console().print(f"{url}: [{color}]{state}[/{color}]{extra}")
    if status != 200:
        raise typer.Exit(1)


@ctl.command("stats")
def stats(url: str = URL, api_key: Optional[str] = API_KEY, as_json: bool = AS_JSON,
          timeout: float = TIMEOUT) -> None:
    """Requests, tokens, throughput, time to first token, KV use (and the expert cache when there is one)."""
    from rich.console import Console

    _, body = _get(url, "/v1/stats", api_key, timeout)
    if as_json:
        typer.echo(json.dumps(body, indent=2))
        return
    Console().print(stats_table(body))


@ctl.command("cache")
def cache(url: str = URL, api_key: Optional[str] = API_KEY, as_json: bool = AS_JSON,
          timeout: float = TIMEOUT) -> None:
    """The caches of the stats: the prefix cache (kept request states) and the expert cache (MoE offload)."""
    from rich.console import Console

    _, body = _get(url, "/v1/stats", api_key, timeout)
    moe, prefix = body.get("moe"), body.get("prefix_cache")
    if as_json:
        typer.echo(json.dumps({"prefix_cache": prefix, "moe": moe}, indent=2))
        return
    console = Console()
    from rich.table import Table

    if prefix:
        table = Table(title=f"prefix cache: {body.get('model', url)}", show_header=False)
        for key, value in _flatten(prefix):
            table.add_row(key, _fmt(value))
        console.print(table)
    else:
        console.print("prefix cache: off (--prefix-cache-entries 0)")
    if not moe:
        console.print(f"{body.get('model', url)}: this server has no expert cache (experts run on the CPU from the "
                      "memory-mapped FTW; the GPU cache exists only when serving on CUDA)")
        return
    table = Table(title=f"expert cache: {body.get('model', url)}", show_header=False)
    for key, value in _flatten(moe):
        table.add_row(key, _fmt(value))
    console.print(table)


def stats_table(s: dict) -> Any:
    from rich.table import Table

    req, tok, thr, kv, sched = s["requests"], s["tokens"], s["throughput"], s["kv"], s["scheduler"]
    table = Table(title=f"{s['model']} ({s['status']}, up {s['uptime_s']:.0f} s)", show_header=False)
    table.add_row("requests", f"{req['active']} active, {req['completed']} completed, {req['disconnected']} "
                              f"disconnected, {req['rejected']} rejected (queue full), {req['errors']} errors")
    if req["by_endpoint"]:
        table.add_row("by endpoint", ", ".join(f"{k} {v}" for k, v in sorted(req["by_endpoint"].items())))
    table.add_row("tokens", f"{tok['prompt_total']} prompt, {tok['completion_total']} completion "
                            f"({tok['generated_total']} generated)")
    table.add_row("throughput", f"{thr['tok_s']:.1f} tok/s over the last {thr['window_s']:.0f} s; engine decode "
                                f"{_fmt(thr['engine_decode_tok_s'])} tok/s, prefill "
                                f"{_fmt(thr['engine_prefill_tok_s'])} tok/s")
    for key, title in (("ttft_ms", "time to first token"), ("latency_ms", "request latency")):
        v = s[key]
        table.add_row(title, "no requests yet" if not v["count"] else
                      f"mean {v['mean']:.1f} ms, p50 {v['p50']:.1f} ms, p95 {v['p95']:.1f} ms (n={v['count']})")
    util = f" ({100 * kv['utilization']:.1f} %)" if kv["utilization"] is not None else ""
    table.add_row("KV", f"{_fmt(kv['used_tokens'])} / {_fmt(kv['total_tokens'])} tokens reserved{util}")
    table.add_row("scheduler", f"{_fmt(sched['running'])} running, {_fmt(sched['waiting'])} waiting")
    pc = s.get("prefix_cache")
    host = f", {pc['host_entries']} in host memory ({pc['host_bytes'] / 2**20:.0f} MiB)" if pc and pc.get(
        "host_entries") else ""
    table.add_row("prefix cache", "off" if not pc else f"{pc['hits']} hits ({pc['hit_tokens']} tokens), "
                                                       f"{pc['entries']} kept states, {pc['kv_tokens_held']} KV "
                                                       f"tokens{host}")
    table.add_row("expert cache", "none (CPU experts)" if not s.get("moe") else "see `ft ctl cache`")
    return table


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1 else f"{value:,.1f}"
    return str(value)
