"""Expert sources: where one MoE layer's experts come from, which FTW bank scheme they get, and each expert's record.

A family names its layer's experts with an `ExpertSource` (plan data). `resolve` checks it against the checkpoint
headers and returns a `Bank` that knows its scheme, the source tensors it consumes and how to build expert e's
components (families.md "Expert banks"). A new on-disk expert format (gpt-oss MXFP4 blocks with biases, DeepSeek FP8
block scales) is one more source/bank pair here plus its scheme's components; prepare and emit stay generic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.linear import PLAIN_SCHEME, DtypePolicy, Rows, Sniffed, sniff, to_dtype
from ft.compiler.quant.modelopt import QuantDecl
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
    """transformers' fused 3-D tensors: gate_up [E, 2I, H] (gate rows first), down [E, H, I] (official Qwen3.5 BF16)."""

    gate_up: str
    down: str

    def resolve(self, ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, item: BankItem) -> Bank:
        E, I, H = item.num_experts, item.intermediate, item.hidden
        dts = {ck.float_dtype(self.gate_up), ck.float_dtype(self.down)}
        for name, want in ((self.gate_up, (E, 2 * I, H)), (self.down, (E, H, I))):
            if ck.info(name).shape != want:
                raise CheckpointError(f"{name}: shape {list(ck.info(name).shape)} does not match the config's "
                                      f"{list(want)}")
        dt = pol.dtype or (dts.pop() if len(dts) == 1 else torch.float32)
        return _FusedBank(item, PLAIN_SCHEME[dt], [self.gate_up, self.down], self)


class _FusedBank(Bank):
    def __init__(self, item: BankItem, scheme: str, names: list[str], src: FusedExperts) -> None:
        super().__init__(item, scheme, names)
        self.src = src

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        dt = _DTYPE_OF[self.scheme]
        return {"gate_up": em.read(self.src.gate_up, dt, (e, e + 1))[0],
                "down": em.read(self.src.down, dt, (e, e + 1))[0]}


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
        if "fp8" in schemes and not pol.dequant:
            raise CheckpointError(f"{self.gate.format(e=0)}: FP8 experts have no FTW expert-bank scheme (supported: "
                                  "nvfp4, bf16, fp16, fp32); pass --dequant to store them as bf16")
        if schemes == {"plain"}:
            dts = {ck.info(f"{sn.module}.weight").torch_dtype for trio in trios for sn in trio}
            dt = pol.dtype or (dts.pop() if len(dts) == 1 else torch.float32)
        else:  # dequantized: --dequant, or a layer mixing encodings
            dt = pol.plain
        return _PerExpertBank(item, PLAIN_SCHEME[dt], names, trios)


class _PerExpertBank(Bank):
    def __init__(self, item: BankItem, scheme: str, names: list[str], trios: list[tuple[Sniffed, ...]]) -> None:
        super().__init__(item, scheme, names)
        self.trios = trios

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        em.prefetch([n for sn in self.trios[e] for n in sn.names])  # ~9 small tensors side by side in the file
        gate, up, down = (em.rows(sn, None) for sn in self.trios[e])
        if self.scheme == "nvfp4":
            # gate_up = gate rows then up rows, handed to the writer as (gate, up) pieces (no concatenated copy);
            # per-row scale_2: gate rows carry gate_proj's global, up rows up_proj's
            g, u = gate.t, up.t
            return {"gate_up": (g["weight"], u["weight"]), "gate_up_scale": (g["weight_scale"], u["weight_scale"]),
                    "gate_up_scale_2": (g["weight_scale_2"], u["weight_scale_2"]), "down": down.t["weight"],
                    "down_scale": down.t["weight_scale"], "down_scale_2": down.t["weight_scale_2"]}
        dt, what = _DTYPE_OF[self.scheme], f"{self.item.name} expert {e}"

        def plain(r: Rows) -> torch.Tensor:
            return to_dtype(r.t["weight"], dt, what) if r.scheme == "plain" else em.dequant_to(r, dt, what)

        return {"gate_up": torch.cat([plain(gate), plain(up)]), "down": plain(down)}
