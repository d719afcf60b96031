"""`ft serve`: OpenAI- and Anthropic-compatible server over one FTW (see specs/server.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ft.cli.gpu_options import DENSE_WEIGHTS, ENFORCE_EAGER, OFFLOAD_MODE


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    ftw: Path = typer.Option(..., "--ftw", help="FTW directory written by `ft checkpoint`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address. The default serves this machine only; "
                             "0.0.0.0 exposes the server to the network (set --api-key)."),
    port: int = typer.Option(1919, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FT_API_KEY",
                                          help="Require this key as 'Authorization: Bearer KEY' or 'x-api-key' "
                                               "(/health stays open). Default: $FT_API_KEY, else no auth."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id in /v1/models and responses "
                                                         "(default: the FTW directory name)."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available, else cpu), cpu, or cuda[:N]."),
    kv_reserve_tokens: int = typer.Option(8192, "--kv-reserve-tokens",
                                          help="KV budget in tokens shared by all running requests; each request "
                                               "reserves prompt + max_tokens (capped by the context) on admission."),
    max_prefill_length: int = typer.Option(2048, "--max-prefill-length",
                                           help="Prompt tokens per prefill chunk; chunks interleave with decoding."),
    max_output_tokens: int = typer.Option(32768, "--max-output-tokens",
                                          help="Per-request output cap; larger max_tokens values are clamped to it."),
    max_running_requests: int = typer.Option(4, "--max-running-requests",
                                             help="Requests decoded together in one batch."),
    max_queued_requests: int = typer.Option(64, "--max-queued-requests",
                                            help="Waiting requests beyond which new ones are refused (OpenAI 429, "
                                                 "Anthropic 529 overloaded_error)."),
    memory_ratio: float = typer.Option(0.9, "--memory-ratio",
                                       help="CUDA only: share of free GPU memory for weights + expert cache + KV, "
                                            "in (0, 1]. Ignored on CPU."),
    vram_budget: Optional[str] = typer.Option(None, "--vram-budget",
                                              help="CUDA only: VRAM for everything the engine allocates (dense "
                                                   "weights, KV, expert cache), e.g. 8GiB or 12e9; overrides "
                                                   "--memory-ratio."),
    dense_weights: str = DENSE_WEIGHTS,
    offload_mode: str = OFFLOAD_MODE,
    enforce_eager: bool = ENFORCE_EAGER,
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Serve an FTW with OpenAI (/v1/chat/completions, /v1/completions, /v1/responses) and Anthropic
    (/v1/messages) APIs. The port is bound at once; GET /health answers 503 until the weights are loaded."""
    from rich.console import Console

    from ft.runtime.server.state import ServeSettings

    err = Console(stderr=True, soft_wrap=True)
    if not ftw.is_dir():
        err.print(f"[red]error[/red]: --ftw {ftw} is not a directory (expected an FTW written by `ft checkpoint`)")
        raise typer.Exit(2)
    if log_level not in ("debug", "info", "warning", "error"):
        err.print(f"[red]error[/red]: --log-level {log_level!r}; use debug, info, warning or error")
        raise typer.Exit(2)
    try:
        from ft.runtime.gpu.sizing import parse_bytes

        budget = parse_bytes(vram_budget) if vram_budget is not None else None
        settings = ServeSettings(ftw=ftw, host=host, port=port, api_key=api_key,
                                 served_model_name=served_model_name, device=device,
                                 kv_reserve_tokens=kv_reserve_tokens, max_prefill_length=max_prefill_length,
                                 max_output_tokens=max_output_tokens, max_running_requests=max_running_requests,
                                 max_queued_requests=max_queued_requests, memory_ratio=memory_ratio,
                                 vram_budget=budget, dense_weights=dense_weights, offload_mode=offload_mode,
                                 cuda_graphs=not enforce_eager)
    except ValueError as e:
        err.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2)
    if device == "auto":
        import dataclasses

        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        settings = dataclasses.replace(settings, device=device)
    from ft.runtime.server.app import serve as run_server

    err.print(f"serving [bold]{settings.model_name}[/bold] from {ftw} on http://{host}:{port} (device {device}); "
              f"auth {'on' if api_key else 'off'}")
    run_server(settings, log_level=log_level)
