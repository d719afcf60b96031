"""`ft synth`: synthetic Hugging Face MoE checkpoints with the exact on-disk layout of real releases, random weights.

    synth(arch, preset, out_dir, *, dtype=None, quant="none", routing="uniform", seed=0, force=False,
          expert_layout="auto", overrides=None, max_shard_size=None, num_layers=None, twin=True) -> Path

    tensor_table(arch, preset, ...) -> list[TensorSpec]   # what synth would write, computed without any data

Writes sharded safetensors + index, a config.json / generation_config.json in the style of the real release, the real
Qwen tokenizer files, the fake extra tensors real checkpoints carry (mtp.*, model.visual.*), and with
`quant="nvfp4"` the ModelOpt NVFP4 layout (`quant="mxfp4"`: gpt_oss's MXFP4 experts, `synth.gpt_oss`; `quant="fp8"`:
the 128x128 block-FP8 layout of Qwen3-*-FP8 / GLM-*-FP8 / GLM-5-FP8, in-memory presets, `fp8_checkpoint`;
`quant="fp4"`: DeepSeek-V4's release, block-FP8 with E8M0 scales and FP4 experts, `fp4_checkpoint`) plus its exact
BF16 twin in `<out_dir>-twin` (`twin=False` writes the
quantized checkpoint alone: the qwen3.6-35b-a3b twin is 72 GB). Both directories are written into temporary siblings
and renamed into place when complete. How values are chosen: `weights`; expert
popularity (uniform / Zipf-skewed): `routing`; NVFP4 choices: `nvfp4_checkpoint`; big presets: `full_size`.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path

from ft.compiler.synth.presets import ARCHS, FULL_SIZE, PRESETS, lookup
from ft.compiler.synth.routing import ROUTINGS

__all__ = ["ARCHS", "PRESETS", "FULL_SIZE", "QUANTS", "LAYOUTS", "SynthError", "synth", "tensor_table",
           "resolve_layout"]

QUANTS = ("none", "nvfp4", "mxfp4", "fp8", "fp4")
# every other arch: none, nvfp4, fp8 (glm_moe_dsa: no NVFP4 layout of GLM-5's MLA projections defined; deepseek_v4:
# its release, "fp4", FP8 dense with E8M0 scales and FP4 experts)
_QUANTS_OF = {"gpt_oss": ("none", "mxfp4"), "glm_moe_dsa": ("none", "fp8"), "deepseek_v4": ("none", "fp4")}
LAYOUTS = ("auto", "fused", "per_expert")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


class SynthError(ValueError):
    """Bad synth input (unknown arch/preset/quant, impossible combination, existing output)."""


def resolve_layout(arch: str, quant: str, expert_layout: str) -> bool:
    """True when experts are stored fused in 3-D (official Qwen3.5/3.6 BF16 layout)."""
    if expert_layout not in LAYOUTS:
        raise SynthError(f"unknown expert_layout {expert_layout!r}; supported: {', '.join(LAYOUTS)}")
    if expert_layout == "fused" and arch != "qwen3_5_moe":
        raise SynthError(f"expert_layout 'fused' exists only for qwen3_5_moe; {arch} checkpoints store experts per "
                         f"expert (use auto or per_expert)")
    if expert_layout == "fused" and quant != "none":
        raise SynthError("expert_layout 'fused' exists only unquantized; NVFP4 and FP8 releases store experts per "
                         "expert")
    if expert_layout == "auto":
        return arch == "qwen3_5_moe" and quant == "none"
    return expert_layout == "fused"


def parse_size(value: str | int | None, default: int) -> int:
    """'500MB' / '4GB' / '256KB' / bytes -> bytes (decimal units, like transformers' max_shard_size)."""
    if value is None:
        return default
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise SynthError(f"max_shard_size {value!r}: expected a size like 500MB, 4GB or a byte count")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit]
    return int(float(m.group(1)) * scale)


def _check_out(path: Path, force: bool) -> None:
    if path.exists() and not path.is_dir():
        raise SynthError(f"--out {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise SynthError(f"--out {path} exists and is not empty; pass --force to replace it")


def _preset_keys(arch: str, preset: str, overrides: dict | None, num_layers: int | None) -> dict:
    from ft.compiler.synth.hf_config import FAMILIES

    keys = copy.deepcopy(PRESETS[preset].configs[arch])
    if num_layers is not None:
        if num_layers < 1:
            raise SynthError(f"num_layers must be >= 1, got {num_layers}")
        keys["num_hidden_layers"] = num_layers
    if overrides:
        import transformers

        cls = transformers.Qwen3_5MoeTextConfig if arch == "qwen3_5_moe" else getattr(transformers, FAMILIES[arch][0])
        known = (set(cls().to_dict()) | set(getattr(cls, "__dataclass_fields__", {})) | set(cls.attribute_map)
                 | set(keys) | {"rope_theta", "partial_rotary_factor", "mrope_section", "full_attention_interval",
                                "head_dim", "vision"})
        bad = sorted(set(overrides) - known)
        if bad:
            raise SynthError(f"overrides {bad} are not {cls.__name__} keys")
        keys.update(copy.deepcopy(overrides))
        if "layer_types" in overrides:
            keys.pop("full_attention_interval", None)
    return keys


def _resolve(arch: str, preset: str, dtype: str | None, quant: str, routing: str, expert_layout: str,
             overrides: dict | None, num_layers: int | None):
    """Validated (preset, config keys, torch dtype, fused) or SynthError naming what exists."""
    from ft.compiler.synth.hf_config import DTYPES

    try:
        p = lookup(arch, preset)
    except ValueError as e:
        raise SynthError(str(e)) from None
    if quant not in QUANTS:
        raise SynthError(f"unknown quant {quant!r}; supported: {', '.join(QUANTS)}")
    if arch == "gpt_oss" and (routing != "uniform" or expert_layout != "auto"):
        raise SynthError("gpt_oss checkpoints have uniform routing only and their experts are always fused 3-D on "
                         "disk (routing 'uniform', expert_layout 'auto')")
    allowed = _QUANTS_OF.get(arch, ("none", "nvfp4", "fp8"))
    if quant not in allowed:
        raise SynthError(f"quant {quant!r} does not exist for {arch}; supported: {', '.join(allowed)}")
    if quant in ("fp8", "fp4") and p.kind != "hf":
        raise SynthError(f"quant {quant!r} is written for the in-memory presets only "
                         f"({', '.join(n for n, q in PRESETS.items() if q.kind == 'hf')}), not {preset!r}")
    if routing not in ROUTINGS:
        raise SynthError(f"unknown routing {routing!r}; supported: {', '.join(ROUTINGS)}")
    dtype = dtype or p.dtype
    if dtype not in DTYPES:
        raise SynthError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    fused = resolve_layout(arch, quant, expert_layout)
    return p, _preset_keys(arch, preset, overrides, num_layers), DTYPES[dtype], fused


def tensor_table(arch: str, preset: str, *, dtype: str | None = None, quant: str = "none",
                 expert_layout: str = "auto", overrides: dict | None = None, num_layers: int | None = None) -> list:
    """The checkpoint's tensors (name, shape, dtype) as `synth` would write them, without writing or generating data.

    Computed on the meta device for every preset (the same table save_pretrained writes; tested for tiny presets)."""
    import tempfile

    from ft.compiler.synth.build import plan_table

    p, keys, torch_dtype, fused = _resolve(arch, preset, dtype, quant, "uniform", expert_layout, overrides, num_layers)
    if arch == "gpt_oss":
        from ft.compiler.synth.gpt_oss_stream import gpt_oss_table

        with tempfile.TemporaryDirectory(prefix="ft-synth-table-") as tmp:
            return gpt_oss_table(p, keys, torch_dtype, quant, Path(tmp))
    with tempfile.TemporaryDirectory(prefix="ft-synth-table-") as tmp:
        return plan_table(arch=arch, preset=p, keys=keys, dtype=torch_dtype, quant=quant, fused=fused,
                          tok_dir=Path(tmp))


def synth(arch: str, preset: str, out_dir: Path, *, dtype: str | None = None, quant: str = "none",
          routing: str = "uniform", seed: int = 0, force: bool = False, expert_layout: str = "auto",
          overrides: dict | None = None, max_shard_size: str | None = None, num_layers: int | None = None,
          twin: bool = True) -> Path:
    """Write a synthetic checkpoint of `arch` at `preset` into out_dir (and `<out_dir>-twin` when quantized unless
    `twin` is False; the flag has no effect on unquantized checkpoints, which are their own reference)."""
    p, keys, torch_dtype, fused = _resolve(arch, preset, dtype, quant, routing, expert_layout, overrides, num_layers)
    out_dir = Path(out_dir).absolute()
    twin_dir = out_dir.with_name(out_dir.name + "-twin")
    write_twin = quant in ("nvfp4", "mxfp4", "fp8", "fp4") and twin
    _check_out(out_dir, force)
    if write_twin:
        _check_out(twin_dir, force)
    shard = parse_size(max_shard_size, p.max_shard_size)

    from ft.compiler.synth.build import build_checkpoint

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp_twin = twin_dir.with_name(f".{twin_dir.name}.tmp-{os.getpid()}") if write_twin else None
    try:
        for d in (tmp, tmp_twin):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
        if arch == "gpt_oss":
            from ft.compiler.synth.gpt_oss import build_gpt_oss

            build_gpt_oss(preset=p, keys=keys, dtype=torch_dtype, quant=quant, seed=seed, shard=shard, out=tmp,
                          twin=tmp_twin)
        else:
            build_checkpoint(arch=arch, preset=p, keys=keys, dtype=torch_dtype, quant=quant, routing=routing,
                             seed=seed, fused=fused, shard=shard, out=tmp, twin=tmp_twin)
        _commit(tmp, out_dir)
        if tmp_twin is not None:
            _commit(tmp_twin, twin_dir)
    finally:
        for d in (tmp, tmp_twin):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
    return out_dir


def _commit(tmp: Path, final: Path) -> None:
    """Replace `final` by the finished `tmp` directory (rename; the old one is removed first when forced)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
