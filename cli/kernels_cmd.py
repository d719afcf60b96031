"""`ft kernels build`: thin wrapper over ft.compiler.kernels (prebuilt Triton kernels stored in an FTW)."""

from __future__ import annotations

from pathlib import Path

import typer

kernels_app = typer.Typer(help="Prebuilt GPU kernels stored in an FTW (no JIT compile at start).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(kernels_app, name="kernels")


ARCH_HELP = ("CUDA architectures, comma-separated (80 A100, 86 RTX 30xx, 89 RTX 40xx, 90 H100/H200, 100 B200, "
             "120 RTX 50xx).")


@kernels_app.command("build")
def build(ftw: Path = typer.Option(..., "--ftw", help="FTW directory to add the kernels to."),
          arch: str = typer.Option("80,86,89,90,100,120", "--arch", help=ARCH_HELP),
          groups: str | None = typer.Option(None, "--groups", help="Only these kernel groups (comma-separated; "
                                                                   "default all: fused, router, attention, deltanet, "
                                                                   "dense, embedding, moe)."),
          max_prefill_length: int = typer.Option(4096, "--max-prefill-length", min=1,
                                                 help="Largest prefill chunk the server will run (ft serve "
                                                      "--max-prefill-length); longer chunks compile at run time.")):
    """Compile every Triton kernel the runtime launches for this model, for each architecture (no GPU needed), and
    store them in the FTW's kernels/ slot; they are trusted on this machine."""
    run_build(ftw, arch, groups.split(",") if groups else None, max_prefill_length)


def run_build(ftw: Path, arch: str, groups: list[str] | None, max_prefill_length: int) -> None:
    """Shared by `ft kernels build` and `ft checkpoint --kernels`: build, then print one line per arch."""
    from rich.console import Console
    from rich.markup import escape

    from ft.compiler.kernels import add_kernels, parse_archs

    console = Console(stderr=True, soft_wrap=True)
    try:
        archs = parse_archs(arch)
        with console.status("compiling kernels") as status:
            count = [0]

            def event(text: str) -> None:
                if ": " in text:
                    count[0] += 1
                status.update(f"compiling kernels: {escape(text)} ({count[0]} compiled)")

            results = add_kernels(ftw, archs, groups=groups, max_prefill=max_prefill_length, on_event=event)
    except (OSError, ValueError, RuntimeError) as e:
        console.print(f"[red]error[/red] {escape(str(e))}")
        raise typer.Exit(1)
    for r in results:
        for err in r.errors:
            console.print(f"[yellow]warning[/yellow] sm_{r.arch}: {escape(err)}")
        failed = f", {len(r.errors)} failed to build (launching them fails the same way)" if r.errors else ""
        typer.echo(f"sm_{r.arch}: {r.kernels} kernels, {r.launchers} launchers, {r.nbytes / 2**20:.1f} MiB -> "
                   f"{r.entry}{failed}")
    if results and results[0].launchers_skipped:
        console.print(f"[yellow]warning[/yellow] host launchers not prebuilt: {escape(results[0].launchers_skipped)}; "
                      f"Triton builds what it needs on the serving machine")
    typer.echo(f"{ftw}: kernels trusted on this machine")
