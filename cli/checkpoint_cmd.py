"""`ft checkpoint`: compile a Hugging Face checkpoint (directory or repo id) into an FTW directory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("checkpoint")(checkpoint)


def checkpoint(
    model: str = typer.Option(..., "--model", help="Checkpoint directory, or a Hugging Face repo id (org/name)."),
    out: Path = typer.Option(..., "--out", help="FTW directory to create."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (keep the checkpoint's), bf16, fp16 or fp32."),
    dequant: bool = typer.Option(False, "--dequant", help="Dequantize NVFP4/FP8 weights exactly into plain weights of "
                                                          "--dtype, else of the checkpoint's dtype (bf16 for ModelOpt "
                                                          "releases)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="Quantize the routed experts of a BF16/FP16/FP32 "
                                                                    "or block-FP8 checkpoint at compile time: nvfp4 "
                                                                    "(ModelOpt's NVFP4 recipe; the GPU expert cache "
                                                                    "needs it)."),
    quantize_dense: Optional[str] = typer.Option(None, "--quantize-dense", help="Also quantize the plain attention, "
                                                 "DeltaNet, dense-MLP and shared-expert projections and the LM head: "
                                                 "fp8 (one scale per row) or nvfp4. At small VRAM budgets the GPU "
                                                 "runtime keeps them quantized, leaving the room to the expert cache."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads quantizing experts (--quantize) while the "
                                                                  "source is read and the FTW written (default: all "
                                                                  "cores). The output does not depend on it."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
    verify: str = typer.Option("sample", "--verify", help="Final check before the output is moved into place. "
                                                          "sample: every structural rule of `ft verify`, and the "
                                                          "checksums and padding of a 256 MiB sample re-read from "
                                                          "disk (the writer computed every checksum from the bytes "
                                                          "it wrote). full: re-read and check every byte, like "
                                                          "`ft verify` (adds a read of the whole output)."),
    kernels: Optional[str] = typer.Option(None, "--kernels", help="Also build the runtime's GPU kernels for these "
                                                                  "CUDA architectures (e.g. 90, or 80,86,89,90,100,"
                                                                  "120) into the FTW, as `ft kernels build` does."),
) -> None:
    """Compile MoE safetensors (BF16/FP16/FP32 or ModelOpt NVFP4/FP8) into FTW, check the result (--verify), then
    move it into place. `ft verify OUT` re-reads every byte at any later time."""
    from rich.console import Console
    from rich.markup import escape

    from ft.compiler import CheckpointError, compile_checkpoint

    console = Console(stderr=True, soft_wrap=True)
    try:
        if kernels:  # refused before the compile, not after it
            from ft.compiler.kernels import parse_archs

            parse_archs(kernels)
        path = compile_checkpoint(model, out, revision=revision, dtype=dtype, dequant=dequant, force=force,
                                  progress=progress, verify=verify, quantize=quantize, threads=threads,
                                  quantize_dense=quantize_dense)
    except (CheckpointError, ValueError) as e:
        console.print(f"[red]error[/red] {escape(str(e))}")
        raise typer.Exit(1)
    console.print(f"[green]OK[/green] {escape(str(path))}")
    if kernels:
        from ft.cli.kernels_cmd import run_build

        run_build(path, kernels, None, 4096)
