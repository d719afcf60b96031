"""Shared fixtures for all tests: tiny synthetic checkpoints compiled to FTW once per test session.

    def test_x(ftw_for):
        path = ftw_for("qwen3_moe", "none")     # -> Path of a compiled FTW (tiny preset)
    def test_y(hf_for):
        hf_dir = hf_for("qwen3_moe", "nvfp4")   # -> the synthetic HF checkpoint; its BF16 twin is twin_for(...)

Everything lives in one session-scoped temporary directory; each (arch, quant) pair is synthesized and compiled at
most once, whichever test asks first.

Tiny models gain nothing from intra-op threads, and on a busy 2-core runner OpenMP spinning makes them 10x slower,
so runtime tests run torch single-threaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

QUANTS = ("none", "nvfp4", "mxfp4", "fp8", "fp4")

torch.set_num_threads(1)


class TinyCheckpoints:
    """Builds and caches tiny synthetic checkpoints and their FTWs under `root`.

    `synth_dtype` is the checkpoint dtype (None: the tiny preset's fp32); `dtype` is the compiler's --dtype."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._hf: dict[tuple, Path] = {}
        self._ftw: dict[tuple, Path] = {}

    def hf(self, arch: str, quant: str = "none", synth_dtype: str | None = None) -> Path:
        if quant not in QUANTS:
            raise ValueError(f"quant {quant!r}; supported here: {QUANTS}")
        key = (arch, quant, synth_dtype)
        if key not in self._hf:
            from ft.compiler.synth import synth

            out = self.root / f"{arch}-{quant}-{synth_dtype or 'preset'}-hf"
            self._hf[key] = Path(synth(arch, "tiny", out, dtype=synth_dtype, quant=quant, seed=0))
        return self._hf[key]

    def twin(self, arch: str, synth_dtype: str | None = None, quant: str = "nvfp4") -> Path:
        """The exact-dequantized twin written next to the NVFP4 / FP8 (gpt_oss: MXFP4; deepseek_v4: FP4) checkpoint."""
        hf = self.hf(arch, quant, synth_dtype)
        twin = hf.parent / f"{hf.name}-twin"
        if not twin.is_dir():
            raise FileNotFoundError(f"synth wrote no twin at {twin}")
        return twin

    def ftw(self, arch: str, quant: str = "none", dtype: str = "auto", synth_dtype: str | None = None) -> Path:
        key = (arch, quant, dtype, synth_dtype)
        if key not in self._ftw:
            from ft.compiler import compile_checkpoint

            out = self.root / f"{arch}-{quant}-{synth_dtype or 'preset'}-{dtype}.ftw"
            self._ftw[key] = Path(compile_checkpoint(self.hf(arch, quant, synth_dtype), out, dtype=dtype))
        return self._ftw[key]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-ckpts"))


@pytest.fixture(scope="session")
def ftw_for(tiny_checkpoints):
    """`ftw_for(arch, quant="none", dtype="auto", synth_dtype=None) -> Path` of the compiled tiny FTW."""
    return tiny_checkpoints.ftw


@pytest.fixture(scope="session")
def hf_for(tiny_checkpoints):
    """`hf_for(arch, quant="none", synth_dtype=None) -> Path` of the synthetic HF checkpoint."""
    return tiny_checkpoints.hf


@pytest.fixture(scope="session")
def twin_for(tiny_checkpoints):
    """`twin_for(arch, synth_dtype=None, quant="nvfp4") -> Path` of the exact twin of the quantized tiny checkpoint."""
    return tiny_checkpoints.twin
