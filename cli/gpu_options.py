"""The CUDA options `ft serve` and `ft generate` share (typer defaults, one definition each)."""

from __future__ import annotations

import typer

DENSE_WEIGHTS = typer.Option("dequantized", "--dense-weights",
                             help="CUDA only: quantized dense linears (FP8 / NVFP4 in ModelOpt checkpoints) "
                                  "dequantized to bf16 at load, or kept as stored and dequantized per call: 2-4x less "
                                  "VRAM for them, left to the expert cache, for extra work per step.")
OFFLOAD_MODE = typer.Option("mapped", "--offload-mode",
                            help="CUDA only: how expert-cache misses are served. hybrid: split between PCIe fetches "
                                 "and CPU compute; mapped: the GPU copies them from page-locked host memory without "
                                 "waiting for the host; offload: every miss fetched; cpu: every miss on the CPU.")
ENFORCE_EAGER = typer.Option(False, "--enforce-eager",
                             help="CUDA only: never replay decode steps from CUDA graphs (by default a one-token step "
                                  "is captured once per sequence and replayed when every MoE layer is sync-free: "
                                  "modes mapped and resident).")
