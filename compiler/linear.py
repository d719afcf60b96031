"""Linear weights in a row-wise encoding, so fusing and regrouping work the same for every scheme.

A `Rows` holds one linear's tensors with the output rows as dim 0 of every tensor:

  plain  {"weight": [out, in] float}
  nvfp4  {"weight": u8 [out, in/2], "weight_scale": f8_e4m3 [out, in/16], "weight_scale_2": f32 [out]}
  fp8    {"weight": f8_e4m3 [out, in], "weight_scale": f32 [out]}
  fp8_block {"weight": f8_e4m3 [out, in], "weight_scale_inv": f32 [out, ceil(in/128)]}  (128x128 tiles; the tile
         grid [ceil(out/128), ceil(in/128)] is expanded along the rows on load, ft.compiler.quant.fp8_block; scales
         stored as F32, or E8M0 with scale_fmt "ue8m0", under `weight_scale_inv` or DeepSeek-V4's `scale`, become
         their exact float32 values on load)
  mxfp4  {"weight": u8 [out, in/2], "weight_scale": u8 [out, in/32]}  (DeepSeek-V4's FP4 experts, expert_dtype
         "fp4": I8 E2M1 pairs, element 2j in the low nibble, and one E8M0 scale per 32 inputs, the bytes of
         ft.formats.quant.mxfp4; only expert banks take it)

Per-tensor globals are broadcast to one value per row on load. Row concatenation (q|k|v, gate|up) and row
permutation (de-interleaving, per-head regrouping) are then plain `cat`/`index_select` on each tensor: exact, bit for
bit, even when the fused sources carried different per-tensor scales (families.md, "Quantized linears").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.quant import fp8_block
from ft.compiler.source import Checkpoint, TensorInfo

# FTW scheme names for plain float linears and banks
PLAIN_SCHEME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# tensors a quantized checkpoint carries that W4A16 / weight-only execution does not use
AUX_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".q_scale", ".output_scale", ".prob_scale")


@dataclass(frozen=True)
class Sniffed:
    """What the header says about one HF linear module: its scheme, logical [out, in] and its tensor names."""

    module: str
    scheme: str  # plain | nvfp4 | fp8 | fp8_block | mxfp4
    out_features: int
    in_features: int
    names: tuple[str, ...]


def sniff(ck: Checkpoint, module: str) -> Sniffed:
    w = f"{module}.weight"
    if not ck.has(w):
        raise CheckpointError(f"{ck.root.name}: tensor {w!r} not found in the checkpoint")
    info = ck.info(w)
    s, s2 = f"{module}.weight_scale", f"{module}.weight_scale_2"
    if len(info.shape) != 2:
        raise CheckpointError(f"{w}: expected a 2-D linear weight, got shape {list(info.shape)}")
    if ck.has(f"{module}.weight_scale_inv") or ck.has(f"{module}.scale"):
        return _sniff_block(ck, module, info)
    out, cols = info.shape
    if info.dtype in ("F32", "F16", "BF16") and not ck.has(s):
        return Sniffed(module, "plain", out, cols, (w,))
    if info.dtype == "U8" and ck.has(s) and ck.has(s2):
        si, s2i = ck.info(s), ck.info(s2)
        if (si.dtype != "F8_E4M3" or si.shape != (out, cols * 2 // 16)
                or s2i.dtype != "F32" or math.prod(s2i.shape) != 1):
            raise CheckpointError(
                f"{module}: NVFP4 tensors have unexpected layout: weight U8 {list(info.shape)}, weight_scale "
                f"{si.dtype} {list(si.shape)} (want F8_E4M3 [{out}, {cols * 2 // 16}]), weight_scale_2 {s2i.dtype} "
                f"{list(s2i.shape)} (want F32 scalar)")
        return Sniffed(module, "nvfp4", out, cols * 2, (w, s, s2))
    if info.dtype == "F8_E4M3" and ck.has(s):
        si = ck.info(s)
        if si.dtype != "F32" or math.prod(si.shape) not in (1, out):
            raise CheckpointError(f"{module}: FP8 weight_scale is {si.dtype} {list(si.shape)}; supported: F32 "
                                  f"per-tensor scalar or per-row [{out}]")
        return Sniffed(module, "fp8", out, cols, (w, s))
    raise CheckpointError(f"{w}: dtype {info.dtype} with the tensors present is not a supported encoding; supported: "
                          "F32/F16/BF16, ModelOpt NVFP4 (U8 + weight_scale + weight_scale_2), FP8 + F32 weight_scale, "
                          "FP8 + F32 or E8M0 weight_scale_inv / scale (128x128 blocks), I8 FP4 experts + E8M0 scale")


def _sniff_block(ck: Checkpoint, module: str, info: TensorInfo) -> Sniffed:
    """128x128 block-scaled FP8: weight F8_E4M3 [N, K] + weight_scale_inv (or DeepSeek-V4's `scale`) [ceil(N/128),
    ceil(K/128)], F32 or E8M0 as the config's scale_fmt says; or an FP4 expert (I8 [N, K/2] + E8M0 [N, K/32])."""
    w = f"{module}.weight"
    si = f"{module}.weight_scale_inv" if ck.has(f"{module}.weight_scale_inv") else f"{module}.scale"
    out, cols = info.shape
    sinfo, fmt = ck.info(si), fp8_block.scale_fmt(ck.config)
    dts = fp8_block.SCALE_FMTS.get(fmt)
    if dts is None:
        raise CheckpointError(f"{si}: scale_fmt {fmt!r} is not supported; supported: "
                              f"{', '.join(map(repr, fp8_block.SCALE_FMTS))}")
    if info.dtype == "I8":
        return _sniff_fp4(module, info, si, sinfo, fmt)
    if info.dtype != "F8_E4M3":
        raise CheckpointError(f"{w}: dtype {info.dtype} next to a {si.rsplit('.', 1)[1]}; block-scaled FP8 weights "
                              "are F8_E4M3 (FP4 experts I8)")
    want = fp8_block.grid(out, cols)
    if sinfo.dtype not in dts or tuple(sinfo.shape) != want:
        raise CheckpointError(f"{si}: {sinfo.dtype} {list(sinfo.shape)}; a {fp8_block.BLOCK}x{fp8_block.BLOCK} "
                              f"block-FP8 weight [{out}, {cols}] with scale_fmt {fmt!r} needs {' or '.join(dts)} "
                              f"{list(want)}")
    return Sniffed(module, "fp8_block", out, cols, (w, si))


def _sniff_fp4(module: str, info: TensorInfo, si: str, sinfo: TensorInfo, fmt: str) -> Sniffed:
    """FP4 (E2M1 pairs in I8) with one E8M0 scale per row per 32 inputs: transformers' `expert_dtype: "fp4"`."""
    out, half = info.shape
    if fmt != "ue8m0":
        raise CheckpointError(f"{module}.weight: FP4 (I8) weight with scale_fmt {fmt!r}; FP4 experts are read with "
                              "E8M0 scales only (scale_fmt 'ue8m0')")
    if sinfo.dtype not in fp8_block.SCALE_FMTS["ue8m0"] or tuple(sinfo.shape) != (out, half * 2 // 32) or \
            (half * 2) % 32:
        raise CheckpointError(f"{si}: {sinfo.dtype} {list(sinfo.shape)}; an FP4 weight [{out}, {half * 2}] needs "
                              f"F8_E8M0 [{out}, {half * 2 // 32}] (one scale per 32 inputs, inputs a multiple of 32)")
    return Sniffed(module, "mxfp4", out, half * 2, (f"{module}.weight", si))


@dataclass
class Rows:
    scheme: str
    t: dict[str, torch.Tensor]

    @property
    def out_features(self) -> int:
        return self.t["weight"].shape[0]


def load(ck: Checkpoint, read, sn: Sniffed) -> Rows:
    """Read one module's tensors (`read(name)` does the I/O) into row-wise form."""
    t = {n[len(sn.module) + 1:]: read(n) for n in sn.names}
    out = sn.out_features
    if sn.scheme in ("fp8_block", "mxfp4"):
        scale = t.pop("scale") if "scale" in t else t.pop("weight_scale_inv")
        try:
            values = fp8_block.scale_values(scale, sn.names[1])  # exact float32; E8M0 NaN refused
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if sn.scheme == "mxfp4":  # the bytes as they are: E2M1 pairs and E8M0 exponents
            return Rows("mxfp4", {"weight": t["weight"].view(torch.uint8), "weight_scale": scale.view(torch.uint8)})
        t["weight_scale_inv"] = fp8_block.rows_of(values, out)
    if sn.scheme == "nvfp4":
        t["weight_scale_2"] = t["weight_scale_2"].reshape(1).expand(out).contiguous()
    elif sn.scheme == "fp8":
        t["weight_scale"] = t["weight_scale"].reshape(-1).expand(out).contiguous()
    return Rows(sn.scheme, t)


def dequantize(r: Rows) -> torch.Tensor:
    """Exact float32 [out, in] values of any encoding."""
    if r.scheme == "plain":
        return r.t["weight"].float()
    if r.scheme == "nvfp4":
        from ft.formats.quant import nvfp4

        return nvfp4.dequantize(r.t["weight"], r.t["weight_scale"], r.t["weight_scale_2"])
    if r.scheme == "fp8_block":
        return fp8_block.dequantize_rows(r.t["weight"], r.t["weight_scale_inv"])
    if r.scheme == "mxfp4":
        from ft.formats.quant import mxfp4

        return mxfp4.dequantize(r.t["weight"], r.t["weight_scale"])
    from ft.formats.quant import fp8

    return fp8.dequantize(r.t["weight"], r.t["weight_scale"])


def to_dtype(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """Cast with an overflow check: narrowing that turns a finite value into inf is refused, naming the tensor."""
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if dtype in (torch.float16, torch.bfloat16) and t.dtype.is_floating_point and t.dtype.itemsize > 1:
        bad = torch.isinf(out) & ~torch.isinf(t)
        if bool(bad.any()):
            raise CheckpointError(f"{what}: value {float(t[bad][0])} overflows {dtype}; choose a wider --dtype")
    return out


def cat(parts: list[Rows]) -> Rows:
    """Row-concatenate linears of one encoding, tensor by tensor (differing plain dtypes meet in fp32, exactly).
    Mixed encodings are dequantized by the caller first."""
    if len(parts) == 1:
        return parts[0]
    schemes = {p.scheme for p in parts}
    if len(schemes) > 1:
        raise ValueError(f"cat: mixed encodings {sorted(schemes)}")
    if schemes == {"plain"}:
        dts = {p.t["weight"].dtype for p in parts}
        dt = dts.pop() if len(dts) == 1 else torch.float32  # any mix of fp32/fp16/bf16 is exact in fp32
        return Rows("plain", {"weight": torch.cat([p.t["weight"].to(dt) for p in parts])})
    return Rows(parts[0].scheme, {k: torch.cat([p.t[k] for p in parts]) for k in parts[0].t})


def take(r: Rows, rows: torch.Tensor) -> Rows:
    return Rows(r.scheme, {k: v.index_select(0, rows) for k, v in r.t.items()})


@dataclass(frozen=True)
class DtypePolicy:
    """`dtype` None = keep each tensor's source dtype (--dtype auto). `plain` is used where a float dtype must be
    chosen (dequantized weights, mixed-encoding fusions). `dequant` turns every quantized linear into `plain`.
    `quantize` ("nvfp4" or None): routed experts of an unquantized source are quantized at compile time.
    `quantize_dense` ("fp8", "nvfp4" or None): so are the plain dense linears `dense_quantizable` names."""

    dtype: torch.dtype | None
    plain: torch.dtype
    dequant: bool
    quantize: str | None = None
    quantize_dense: str | None = None


# FTW linears `--quantize-dense` quantizes (layer-relative suffixes, and the LM head): the attention, DeltaNet, dense
# MLP and shared-expert projections, which the runtime applies through `Linear` only (routers, gates, indexers, MLA
# down-projections and conv weights stay in their dtype, as in ModelOpt's releases)
DENSE_QUANTIZABLE = ("self_attn.qkv_proj", "self_attn.o_proj", "linear_attn.in_proj_qkvz", "linear_attn.out_proj",
                     "mlp.gate_up_proj", "mlp.down_proj", "mlp.shared_expert.gate_up_proj",
                     "mlp.shared_expert.down_proj")


def dense_quantizable(name: str, in_features: int) -> bool:
    """Whether `--quantize-dense` applies to FTW linear `name` with `in_features` inputs (a multiple of 16: whole
    NVFP4 scale blocks, whole words of the runtime's GEMV)."""
    rel = name.split(".", 2)[2] if name.startswith("layers.") else name
    return in_features % 16 == 0 and (rel in DENSE_QUANTIZABLE or name == "lm_head")


def quantize_dense(r: Rows, scheme: str) -> Rows:
    """A plain linear quantized at compile time: "fp8" -> per-row FP8 (`quant.fp8.quantize_rows`), "nvfp4" ->
    ModelOpt's NVFP4 recipe with one global scale over all rows (fused q|k|v share it, as ModelOpt syncs their amax)."""
    from ft.compiler.quant import fp8, nvfp4

    w = r.t["weight"]
    if scheme == "fp8":
        q, s = fp8.quantize_rows(w)
        return Rows("fp8", {"weight": q, "weight_scale": s})
    q, s, s2 = nvfp4.quantize(w)
    return Rows("nvfp4", {"weight": q, "weight_scale": s, "weight_scale_2": s2.expand(w.shape[0]).contiguous()})


def finalize(r: Rows, pol: DtypePolicy, what: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The FTW encoding of a linear: (scheme, {suffix: tensor}); scheme is fp32/fp16/bf16, nvfp4 or fp8_row.
    (Dequantization, when asked for or when FTW has no such scheme (fp8_block), has already happened: see
    Emitter.linear.)"""
    if r.scheme == "plain":
        w = r.t["weight"] if pol.dtype is None else to_dtype(r.t["weight"], pol.dtype, what)
        return PLAIN_SCHEME[w.dtype], {"weight": w}
    if r.scheme == "nvfp4":
        return "nvfp4", {"weight": r.t["weight"], "weight_scale": r.t["weight_scale"],
                         "weight_scale_2": r.t["weight_scale_2"]}
    if r.scheme != "fp8":
        raise ValueError(f"{what}: {r.scheme} linears have no FTW scheme; they are dequantized before finalize")
    return "fp8_row", {"weight": r.t["weight"], "weight_scale": r.t["weight_scale"]}
