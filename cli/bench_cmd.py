"""`ft bench bw`: measure PCIe, host-memory and CPU-expert bandwidths and save the expert store's profile."""

from __future__ import annotations

import json
from pathlib import Path

import typer

bench_app = typer.Typer(help="Measure this machine for the expert-offload scheduler.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@bench_app.command("bw")
def bw(
    hidden: int = typer.Option(2048, help="Expert hidden size H of the synthetic NVFP4 records."),
    inter: int = typer.Option(512, help="Expert intermediate size I."),
    top_k: int = typer.Option(8, help="Experts per CPU kernel call (decode batch 1)."),
    pool_gib: float = typer.Option(2.0, help="Size of the host record pool (keep it above the last-level cache)."),
    cpu_threads: int = typer.Option(0, help="CPU expert threads (0 = all cores but five)."),
    copy_threads: int = typer.Option(4, help="Threads of the pageable -> pinned staging copy."),
    seconds: float = typer.Option(2.0, help="Duration of the concurrent PCIe + CPU measurement."),
    output: Path = typer.Option(None, "--output", "-o", help="Profile path (default: user cache dir, per GPU)."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile as JSON instead of a table."),
    registered_mmap: bool = typer.Option(False, help="Also time copies from a cudaHostRegister'ed file mapping."),
) -> None:
    """Measure host<->GPU copies, host memory, the CPU NVFP4 expert kernel and both paths at once."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from ft.runtime.gpu.benchbw import run_bench, save_profile

    err = Console(stderr=True)
    if not torch.cuda.is_available():
        err.print("[red]ft bench bw needs a CUDA GPU, and torch sees none on this machine[/red] "
                  f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}).")
        raise typer.Exit(1)
    prof = run_bench(hidden=hidden, inter=inter, top_k=top_k, pool_gib=pool_gib, cpu_threads=cpu_threads or None,
                     copy_threads=copy_threads, seconds=seconds, registered_mmap=registered_mmap,
                     progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    path = save_profile(prof, output)
    if json_out:
        typer.echo(json.dumps(prof, indent=2))
        return
    g = prof["gbs"]
    table = Table(title=f"{prof['gpu']['name']} ({prof['gpu']['uuid']})")
    table.add_column("measurement")
    table.add_column("GB/s", justify="right")
    rows = [("H2D pinned, 1 GiB", "h2d_pinned"), ("D2H pinned, 1 GiB", "d2h_pinned"),
            ("H2D pageable, 256 MiB", "h2d_pageable"), ("H2D expert records, pinned", "h2d_expert_pinned"),
            ("H2D expert records, staged (fetch path)", "h2d_expert_staged"),
            ("H2D expert records, registered file mmap", "h2d_expert_registered_mmap"),
            ("host memory read", "host_read"),
            (f"CPU expert kernel ({g['cpu_backend']}, {prof['cpu']['threads_used']} threads)", "cpu_expert"),
            ("concurrent: PCIe fetch", "concurrent_pcie"), ("concurrent: CPU experts", "concurrent_cpu")]
    for label, key in rows:
        if key not in g:
            continue
        table.add_row(label, f"{g[key]:.1f}" if isinstance(g[key], float) else str(g[key]))
    Console().print(table)
    Console().print(f"fetch share q = B_pcie / (B_pcie + B_cpu) = {prof['fetch_share']:.2f}; profile: {path}")
