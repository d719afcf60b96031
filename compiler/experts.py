"""Expert sources: where one MoE layer's experts come from, which FTW bank scheme they get, and each expert's record.

A family names its layer's experts with an `ExpertSource` (plan data). `resolve` checks it against the checkpoint
headers and returns a `Bank` that knows its scheme, the source tensors it consumes and how to build expert e's
components (families.md "Expert banks"). A new on-disk expert format (DeepSeek FP8 block scales) is one more source/bank
pair here plus its scheme's components (gpt-oss: `GptOssExperts`, MXFP4 or plain, with biases); prepare and emit stay
generic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.linear import PLAIN_SCHEME, DtypePolicy, Rows, Sniffed, sniff, to_dtype
from ft.compiler.quant import fp8_block
from ft.compiler.quant.modelopt import QuantDecl
from ft.compiler.quant.nvfp4 import quantize_rows
from ft.compiler.source import Checkpoint

if TYPE_CHECKING:
    from ft.compiler.emit import Emitter
    from ft.compiler.plan import BankItem

_DTYPE_OF = {v: k for k, v in PLAIN_SCHEME.items()}


class Bank(ABC):
    """One resolved expert bank: `scheme`, `names` (source tensors read), `components()`, `expert(em, e)`."""

    def __init__(self, item: BankItem, scheme: str, names: list[str]) -> None:
        self.item, self.scheme, self.names = item, scheme, names

    def components(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        I, H = self.item.intermediate, self.item.hidden
        if self.scheme == "mxfp4":  # without biases (DeepSeek-V4's FP4 experts); gpt-oss's bank adds them
            u8 = torch.uint8
            return {"gate_up": (u8, (2 * I, H // 2)), "gate_up_scale": (u8, (2 * I, H // 32)),
                    "down": (u8, (H, I // 2)), "down_scale": (u8, (H, I // 32))}
        if self.scheme == "nvfp4":
            u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
            return {"gate_up": (u8, (2 * I, H // 2)), "gate_up_scale": (f8, (2 * I, H // 16)),
                    "gate_up_scale_2": (f32, (2 * I,)),
                    "down": (u8, (H, I // 2)), "down_scale": (f8, (H, I // 16)), "down_scale_2": (f32, (H,))}
        dt = _DTYPE_OF[self.scheme]
        return {"gate_up": (dt, (2 * I, H)), "down": (dt, (H, I))}

    @abstractmethod
    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        """Expert e's components (shapes and dtypes of `components()`); a tuple is a component's dim-0 pieces."""


class ExpertSource(ABC):
    @abstractmethod
    def resolve(self, ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, item: BankItem) -> Bank:
        """Check the source tensors against the config; choose the bank scheme."""


@dataclass(frozen=True)
class FusedExperts(ExpertSource):
    """transformers' fused 3-D tensors: gate_up [E, 2I, H] (gate rows first), down [E, H, I] (official Qwen3.5 BF16),
    plain or block-FP8 (F8_E4M3 with `{name}_scale_inv` F32 [E, ceil(rows/128), ceil(cols/128)] per expert, the
    layout of transformers' FP8 experts; dequantized per expert to the bank dtype, or re-quantized with --quantize)."""

    gate_up: str
    down: str

    def resolve(self, ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, item: BankItem) -> Bank:
        E, I, H = item.num_experts, item.intermediate, item.hidden
        for name, want in ((self.gate_up, (E, 2 * I, H)), (self.down, (E, H, I))):
            if ck.info(name).shape != want:
                raise CheckpointError(f"{name}: shape {list(ck.info(name).shape)} does not match the config's "
                                      f"{list(want)}")
        if ck.has(f"{self.gate_up}_scale_inv"):
            return self._resolve_fp8(ck, decl, pol, item)
        dts = {ck.float_dtype(self.gate_up), ck.float_dtype(self.down)}
        if pol.quantize:
            _check_quantizable(self.gate_up, item)
            return _FusedBank(item, pol.quantize, [self.gate_up, self.down], self)
        dt = pol.dtype or (dts.pop() if len(dts) == 1 else torch.float32)
        return _FusedBank(item, PLAIN_SCHEME[dt], [self.gate_up, self.down], self)

    def _resolve_fp8(self, ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, item: BankItem) -> Bank:
        E, I, H = item.num_experts, item.intermediate, item.hidden
        for name, (rows, cols) in ((self.gate_up, (2 * I, H)), (self.down, (H, I))):
            s = f"{name}_scale_inv"
            if ck.info(name).dtype != "F8_E4M3" or not ck.has(s):
                raise CheckpointError(f"{name}: block-FP8 fused experts need F8_E4M3 {self.gate_up} and {self.down} "
                                      f"with their _scale_inv tensors; got {ck.info(name).dtype}")
            want, fmt = (E, *fp8_block.grid(rows, cols)), fp8_block.scale_fmt(ck.config)
            dts = fp8_block.SCALE_FMTS.get(fmt, ("F32",))
            if ck.info(s).dtype not in dts or ck.info(s).shape != want:
                raise CheckpointError(f"{s}: {ck.info(s).dtype} {list(ck.info(s).shape)}; 128x128 block-FP8 "
                                      f"experts [{E}, {rows}, {cols}] need {' or '.join(dts)} {list(want)}")
        module = self.gate_up.rsplit(".", 1)[0]
        if "fp8_block" not in decl.allowed(module):
            raise CheckpointError(f"{module}: stored as fp8_block, but the checkpoint's quantization config allows "
                                  f"{sorted(decl.allowed(module))} for it")
        if pol.quantize:
            _check_quantizable(self.gate_up, item)
        names = [self.gate_up, f"{self.gate_up}_scale_inv", self.down, f"{self.down}_scale_inv"]
        return _FusedBank(item, pol.quantize or PLAIN_SCHEME[pol.plain], names, self, fp8=True)


class _FusedBank(Bank):
    def __init__(self, item: BankItem, scheme: str, names: list[str], src: FusedExperts, *, fp8: bool = False) -> None:
        super().__init__(item, scheme, names)
        self.src, self.fp8 = src, fp8

    def _values(self, em: Emitter, e: int, dt: torch.dtype) -> list[torch.Tensor]:
        """Expert e's gate_up [2I, H] and down [H, I] in `dt` (block FP8: the float32 dequantization, rounded once)."""
        rows, names = (e, e + 1), (self.src.gate_up, self.src.down)
        if not self.fp8:
            return [em.read(n, dt, rows)[0] for n in names]
        try:
            return [to_dtype(fp8_block.dequantize(em.read(n, None, rows)[0], em.read(f"{n}_scale_inv", None, rows)[0]),
                             dt, f"{n} expert {e}") for n in names]
        except ValueError as err:  # an E8M0 NaN scale
            raise CheckpointError(str(err)) from None

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        if self.scheme == "nvfp4":  # --quantize: gate rows first, then up rows (one global for the pair)
            gate_up, down = self._values(em, e, torch.float32)
            gate, up = gate_up.split(self.item.intermediate)
            return _nvfp4_expert(*quantize_rows(gate, up), *quantize_rows(down))
        gate_up, down = self._values(em, e, _DTYPE_OF[self.scheme])
        return {"gate_up": gate_up, "down": down}


@dataclass(frozen=True)
class PerExpert(ExpertSource):
    """Per-expert 2-D linears (plain, NVFP4 or FP8); `{e}` in each module path is the expert index."""

    gate: str
    up: str
    down: str

    def resolve(self, ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, item: BankItem) -> Bank:
        I, H = item.intermediate, item.hidden
        trios = []
        for e in range(item.num_experts):
            trio = tuple(sniff(ck, m.format(e=e)) for m in (self.gate, self.up, self.down))
            for sn, want in zip(trio, ((I, H), (I, H), (H, I))):
                if (sn.out_features, sn.in_features) != want:
                    raise CheckpointError(f"{sn.module}.weight: logical shape [{sn.out_features}, {sn.in_features}] "
                                          f"does not match the config's {list(want)}")
                if sn.scheme not in decl.allowed(sn.module):
                    raise CheckpointError(f"{sn.module}: stored as {sn.scheme}, but the checkpoint's quantization "
                                          f"config allows {sorted(decl.allowed(sn.module))} for it")
            trios.append(trio)
        names = [n for trio in trios for sn in trio for n in sn.names]
        schemes = {sn.scheme for trio in trios for sn in trio}
        if schemes == {"nvfp4"} and not pol.dequant:
            return _PerExpertBank(item, "nvfp4", names, trios)
        if "mxfp4" in schemes and pol.quantize:
            raise CheckpointError(f"{self.gate.format(e=0)}: the release's FP4 (MXFP4) experts are kept as they are; "
                                  f"--quantize {pol.quantize} would re-quantize 4-bit values (the GPU kernels take "
                                  "MXFP4 records as they take NVFP4)")
        if schemes == {"mxfp4"} and not pol.dequant:  # DeepSeek-V4's FP4 experts: the bytes kept, no biases
            return _PerExpertBank(item, "mxfp4", names, trios)
        if pol.quantize and schemes <= {"plain", "fp8_block"}:  # block FP8 is re-quantized from its float32 values
            _check_quantizable(self.gate.format(e=0), item)
            return _PerExpertBank(item, pol.quantize, names, trios, quantize=True)
        if "fp8" in schemes and not pol.dequant:
            raise CheckpointError(f"{self.gate.format(e=0)}: FP8 experts have no FTW expert-bank scheme (supported: "
                                  "nvfp4, bf16, fp16, fp32); pass --dequant to store them as bf16")
        if schemes == {"plain"}:
            dts = {ck.info(f"{sn.module}.weight").torch_dtype for trio in trios for sn in trio}
            dt = pol.dtype or (dts.pop() if len(dts) == 1 else torch.float32)
        else:  # dequantized: --dequant, block FP8 (no FTW bank scheme), or a layer mixing encodings
            dt = pol.plain
        return _PerExpertBank(item, PLAIN_SCHEME[dt], names, trios)


class _PerExpertBank(Bank):
    def __init__(self, item: BankItem, scheme: str, names: list[str], trios: list[tuple[Sniffed, ...]], *,
                 quantize: bool = False) -> None:
        super().__init__(item, scheme, names)
        self.trios, self.quantize = trios, quantize

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        em.prefetch([n for sn in self.trios[e] for n in sn.names])  # ~9 small tensors side by side in the file
        gate, up, down = (em.rows(sn, torch.float32 if self.quantize else None) for sn in self.trios[e])
        what = f"{self.item.name} expert {e}"

        def plain(r: Rows, dt: torch.dtype) -> torch.Tensor:
            return to_dtype(r.t["weight"], dt, what) if r.scheme == "plain" else em.dequant_to(r, dt, what)

        if self.quantize:  # --quantize: exactly the tensors a ModelOpt export would hold for these float32 values
            f32 = torch.float32
            return _nvfp4_expert(*quantize_rows(plain(gate, f32), plain(up, f32)), *quantize_rows(plain(down, f32)))
        if self.scheme == "nvfp4":
            return _nvfp4_expert(gate.t, up.t, down.t)
        if self.scheme == "mxfp4":  # gate rows then up rows, the codes and E8M0 bytes unchanged
            return {"gate_up": (gate.t["weight"], up.t["weight"]),
                    "gate_up_scale": (gate.t["weight_scale"], up.t["weight_scale"]),
                    "down": down.t["weight"], "down_scale": down.t["weight_scale"]}
        dt = _DTYPE_OF[self.scheme]
        return {"gate_up": torch.cat([plain(gate, dt), plain(up, dt)]), "down": plain(down, dt)}


def _check_quantizable(name: str, item: BankItem) -> None:
    if item.hidden % 16 or item.intermediate % 16:
        raise CheckpointError(f"{name}: --quantize nvfp4 needs hidden and intermediate sizes that are multiples of 16, "
                              f"got {item.hidden} and {item.intermediate}")


def _nvfp4_expert(g: dict, u: dict, d: dict) -> dict[str, tuple[torch.Tensor, ...] | torch.Tensor]:
    """Row-wise NVFP4 gate, up, down -> bank components. gate_up = gate rows then up rows, handed to the writer as
    (gate, up) pieces (no concatenated copy); per-row scale_2: gate rows carry gate_proj's global, up rows up_proj's."""
    return {"gate_up": (g["weight"], u["weight"]), "gate_up_scale": (g["weight_scale"], u["weight_scale"]),
            "gate_up_scale_2": (g["weight_scale_2"], u["weight_scale_2"]), "down": d["weight"],
            "down_scale": d["weight_scale"], "down_scale_2": d["weight_scale_2"]}


@dataclass(frozen=True)
class GptOssExperts(ExpertSource):
    """gpt-oss experts, fused 3-D with biases, `{p}` the layer's `mlp.experts.` prefix. Two on-disk forms:
    MXFP4 (the release): `{p}gate_up_proj_blocks [E, 2I, H/32, 16]` u8, `_scales [E, 2I, H/32]` u8, and `down_proj_*`
    `[E, H, I/32, 16]` / `[E, H, I/32]`; plain (transformers' save_pretrained): `{p}gate_up_proj [E, H, 2I]`,
    `{p}down_proj [E, I, H]` (in x out). Both: `{p}gate_up_proj_bias [E, 2I]`, `{p}down_proj_bias [E, H]`.
    gate_up rows (output units) are interleaved gate, up, gate, ...: de-interleaved here to [gate; up], which for
    MXFP4 is a permutation of whole rows of codes and scales (never a dequantization)."""

    prefix: str

    def resolve(self, ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, item: BankItem) -> Bank:
        E, I, H, p = item.num_experts, item.intermediate, item.hidden, self.prefix
        if pol.quantize:
            raise CheckpointError(f"{p}: --quantize {pol.quantize} is not supported for gpt_oss (its expert banks "
                                  "carry biases, which the NVFP4 bank scheme has not; the release is MXFP4 already)")
        biases = {f"{p}gate_up_proj_bias": (E, 2 * I), f"{p}down_proj_bias": (E, H)}
        if ck.has(f"{p}gate_up_proj_blocks"):
            if (decl.source or {}).get("quant_method") != "mxfp4":
                raise CheckpointError(f"{p}gate_up_proj_blocks: MXFP4 experts, but config.json declares no "
                                      "quantization_config with quant_method 'mxfp4'")
            if H % 32 or I % 32:
                raise CheckpointError(f"{p}: MXFP4 needs hidden and intermediate sizes that are multiples of 32, "
                                      f"got {H} and {I}")
            want = {f"{p}gate_up_proj_blocks": (E, 2 * I, H // 32, 16), f"{p}gate_up_proj_scales": (E, 2 * I, H // 32),
                    f"{p}down_proj_blocks": (E, H, I // 32, 16), f"{p}down_proj_scales": (E, H, I // 32)}
            for name in want:
                if ck.info(name).dtype != "U8":
                    raise CheckpointError(f"{name}: dtype {ck.info(name).dtype}, MXFP4 blocks and scales are U8")
            scheme = pol.plain if pol.dequant else None
        else:
            want = {f"{p}gate_up_proj": (E, H, 2 * I), f"{p}down_proj": (E, I, H)}
            dts = {ck.float_dtype(n) for n in want}
            scheme = pol.dtype or (dts.pop() if len(dts) == 1 else torch.float32)
        for name, shape in {**want, **biases}.items():
            if ck.info(name).shape != shape:
                raise CheckpointError(f"{name}: shape {list(ck.info(name).shape)} does not match the config's "
                                      f"{list(shape)}")
        for name in biases:
            ck.float_dtype(name)
        return _GptOssBank(item, "mxfp4" if scheme is None else PLAIN_SCHEME[scheme], [*want, *biases], self,
                           mxfp4=f"{p}gate_up_proj_blocks" in want)


class _GptOssBank(Bank):
    def __init__(self, item: BankItem, scheme: str, names: list[str], src: GptOssExperts, *, mxfp4: bool) -> None:
        super().__init__(item, scheme, names)
        self.p, self.mxfp4 = src.prefix, mxfp4
        two_i = 2 * item.intermediate
        self.perm = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)])  # [gate rows; up rows]

    def components(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The base bank's components with the biases after their weights (f32 beside MXFP4, else the bank dtype)."""
        comps, I, H = super().components(), self.item.intermediate, self.item.hidden
        dt = torch.float32 if self.scheme == "mxfp4" else _DTYPE_OF[self.scheme]
        gate_up = {k: v for k, v in comps.items() if k.startswith("gate_up")}
        down = {k: v for k, v in comps.items() if k.startswith("down")}
        return {**gate_up, "gate_up_bias": (dt, (2 * I,)), **down, "down_bias": (dt, (H,))}

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        from ft.formats.quant import mxfp4

        p, rows = self.p, (e, e + 1)
        bias_dt = torch.float32 if self.scheme == "mxfp4" else _DTYPE_OF[self.scheme]
        out = {"gate_up_bias": em.read(f"{p}gate_up_proj_bias", bias_dt, rows)[0][self.perm],
               "down_bias": em.read(f"{p}down_proj_bias", bias_dt, rows)[0]}
        if not self.mxfp4:  # [in, out] on disk -> [out, in]
            dt = _DTYPE_OF[self.scheme]
            out["gate_up"] = em.read(f"{p}gate_up_proj", dt, rows)[0].t()[self.perm].contiguous()
            out["down"] = em.read(f"{p}down_proj", dt, rows)[0].t().contiguous()
            return out
        for comp, src, perm in (("gate_up", "gate_up_proj", self.perm), ("down", "down_proj", None)):
            blocks = em.read(f"{p}{src}_blocks", None, rows)[0].flatten(-2)    # [out, in/2]
            scales = em.read(f"{p}{src}_scales", None, rows)[0]                # [out, in/32]
            if perm is not None:
                blocks, scales = blocks[perm], scales[perm]
            if self.scheme == "mxfp4":
                out[comp], out[f"{comp}_scale"] = blocks.contiguous(), scales.contiguous()
            else:  # --dequant: exact values rounded once to the bank dtype
                out[comp] = to_dtype(mxfp4.dequantize(blocks, scales), _DTYPE_OF[self.scheme], f"{p}{src}")
        return out
