"""Expert sources: where one MoE layer's experts come from, which FTW bank scheme they get, and each expert's record.

A family names its layer's experts with an `ExpertSource` (plan data). `resolve` checks it against the checkpoint
headers and returns a `Bank` that knows its scheme, the source tensors it consumes and how to build expert e's
components (families.md "Expert banks"). A new on-disk expert format (DeepSeek FP8 block scales) is one more source/bank
pair here plus its scheme's components (gpt-oss: `experts_gpt_oss.GptOssExperts`, MXFP4 or plain, with biases);
prepare and emit stay generic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

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

DTYPE_OF = {v: k for k, v in PLAIN_SCHEME.items()}


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
        dt = DTYPE_OF[self.scheme]
        return {"gate_up": (dt, (2 * I, H)), "down": (dt, (H, I))}

    @abstractmethod
    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        """Expert e's components (shapes and dtypes of `components()`); a tuple is a component's dim-0 pieces."""

    def job(self, em: Emitter, e: int) -> tuple[Callable[[], dict], int]:
        """Expert e split for `ft.compiler.expert_jobs`: its source read now (this thread, plan order) and a
        thread-safe `build()` -> `expert(em, e)`'s components; plus the bytes read. Default: all of it now."""
        parts = self.expert(em, e)
        return (lambda: parts), 0


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
        if self.scheme == "nvfp4":
            return self.job(em, e)[0]()
        gate_up, down = self._values(em, e, DTYPE_OF[self.scheme])
        return {"gate_up": gate_up, "down": down}

    def job(self, em: Emitter, e: int) -> tuple[Callable[[], dict], int]:
        if self.scheme != "nvfp4":
            return super().job(em, e)
        rows, names = (e, e + 1), (self.src.gate_up, self.src.down)
        raw = [(em.read(n, None, rows)[0], em.read(f"{n}_scale_inv", None, rows)[0] if self.fp8 else None)
               for n in names]  # the source's own dtype: the quantizer widens row chunks itself
        I = self.item.intermediate

        def build() -> dict:  # --quantize: gate rows first, then up rows (one global for the pair)
            try:
                (gate_up, down) = (fp8_block.dequantize(w, s) if s is not None else w for w, s in raw)
            except ValueError as err:  # an E8M0 NaN scale
                raise CheckpointError(f"expert {e}: {err}") from None
            return _nvfp4_expert(*quantize_rows(*gate_up.split(I)), *quantize_rows(down))
        return build, sum(t.nbytes for pair in raw for t in pair if t is not None)


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

    def _read(self, em: Emitter, e: int) -> tuple[Rows, ...]:
        em.prefetch([n for sn in self.trios[e] for n in sn.names])  # ~9 small tensors side by side in the file
        return tuple(em.rows(sn, None) for sn in self.trios[e])

    def job(self, em: Emitter, e: int) -> tuple[Callable[[], dict], int]:
        if not self.quantize:
            return super().job(em, e)
        trio, what = self._read(em, e), f"{self.item.name} expert {e}"

        def build() -> dict:  # --quantize: exactly the tensors a ModelOpt export would hold for these values
            gate, up, down = (r.t["weight"] if r.scheme == "plain" else em.dequant_to(r, torch.float32, what)
                              for r in trio)  # plain weights in their own dtype: the quantizer widens them exactly
            return _nvfp4_expert(*quantize_rows(gate, up), *quantize_rows(down))
        return build, sum(t.nbytes for r in trio for t in r.t.values())

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        if self.quantize:
            return self.job(em, e)[0]()
        gate, up, down = self._read(em, e)
        what = f"{self.item.name} expert {e}"

        def plain(r: Rows, dt: torch.dtype) -> torch.Tensor:
            return to_dtype(r.t["weight"], dt, what) if r.scheme == "plain" else em.dequant_to(r, dt, what)

        if self.scheme == "nvfp4":
            return _nvfp4_expert(gate.t, up.t, down.t)
        if self.scheme == "mxfp4":  # gate rows then up rows, the codes and E8M0 bytes unchanged
            return {"gate_up": (gate.t["weight"], up.t["weight"]),
                    "gate_up_scale": (gate.t["weight_scale"], up.t["weight_scale"]),
                    "down": down.t["weight"], "down_scale": down.t["weight_scale"]}
        dt = DTYPE_OF[self.scheme]
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
