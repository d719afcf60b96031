"""`ft synth`: write a synthetic Hugging Face MoE checkpoint (real on-disk layout, random weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)


def _parse_overrides(items: list[str]) -> dict:
    """KEY=VALUE pairs; VALUE is JSON when it parses (numbers, true/false, lists), else a string."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override {item!r}: expected KEY=VALUE, e.g. mlp_only_layers=[0]")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def synth(
    arch: str = typer.Option(..., "--arch", help="qwen3_moe, qwen2_moe, mixtral, qwen3_next, qwen3_5_moe, "
                              "gpt_oss, glm4_moe, glm_moe_dsa or deepseek_v4."),
    preset: str = typer.Option(..., "--preset", help="tiny, small, demo (qwen3_5_moe) or a full-size release: "
                               "qwen3-30b-a3b, qwen3moe-35b-geom, qwen3.6-35b-a3b, qwen3-next-80b-a3b, "
                               "qwen1.5-moe-a2.7b, mixtral-8x7b, gpt-oss-20b, gpt-oss-120b, glm-4.5-air, glm-4.5."),
    out: Path = typer.Option(..., "--out", help="Directory to create (quantized layouts also write <out>-twin)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 or fp32 (default: fp32 for tiny, else bf16)."),
    quant: str = typer.Option("none", "--quant", help="none, nvfp4 (ModelOpt layout + exact BF16 twin), fp8 "
                              "(128x128 block-FP8 release layout + exact twin; tiny/small/demo; glm_moe_dsa: "
                              "GLM-5-FP8), "
                              "for gpt_oss mxfp4 (the release's MXFP4 experts + exact twin), for deepseek_v4 fp4 "
                              "(DeepSeek-V4's release: FP8 with E8M0 scales, FP4 experts + exact twin)."),
    routing: str = typer.Option("uniform", "--routing", help="uniform, or skewed (Zipf-like expert popularity)."),
    seed: int = typer.Option(0, "--seed", help="Random seed; same seed, same values."),
    expert_layout: str = typer.Option("auto", "--expert-layout",
                                      help="auto, fused (qwen3_5_moe BF16 3-D) or per_expert (2-D)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Cut the preset to this many layers."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="e.g. 500MB, 4GB."),
    override: list[str] = typer.Option([], "--override", help="HF config KEY=VALUE (JSON value); repeatable."),
    no_twin: bool = typer.Option(False, "--no-twin", help="With a quantized --quant: skip the twin <out>-twin."),
    force: bool = typer.Option(False, "--force", help="Replace --out (and its twin) if not empty."),
) -> None:
    """Generate a synthetic checkpoint with the exact tensor names, shapes, dtypes and configs of a real release."""
    from rich.console import Console
    from rich.markup import escape

    from ft.compiler.synth import SynthError
    from ft.compiler.synth import synth as run_synth

    console = Console(stderr=True, soft_wrap=True)
    try:
        path = run_synth(arch, preset, out, dtype=dtype, quant=quant, routing=routing, seed=seed, force=force,
                         expert_layout=expert_layout, overrides=_parse_overrides(override) or None,
                         max_shard_size=max_shard_size, num_layers=layers, twin=not no_twin)
    except SynthError as e:
        console.print(f"[red]error[/red] {escape(str(e))}")
        raise typer.Exit(2)
    except ValueError as e:  # impossible geometry for the request (e.g. NVFP4 with in_features % 16 != 0)
        console.print(f"[red]error[/red] {escape(str(e))}")
        raise typer.Exit(1)
    twin = f" (+ {escape(str(path))}-twin)" if quant in ("nvfp4", "mxfp4", "fp8") and not no_twin else ""
    console.print(f"[green]OK[/green] {escape(str(path))}{twin}")
