"""gpt-oss expert banks (fused 3-D with biases, MXFP4 or plain): the `ExpertSource` / `Bank` pair of
`ft.compiler.experts` for that family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.experts import DTYPE_OF, Bank, ExpertSource
from ft.compiler.linear import PLAIN_SCHEME, DtypePolicy, to_dtype
from ft.compiler.quant.modelopt import QuantDecl
from ft.compiler.source import Checkpoint

if TYPE_CHECKING:
    from ft.compiler.emit import Emitter
    from ft.compiler.plan import BankItem


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
        dt = torch.float32 if self.scheme == "mxfp4" else DTYPE_OF[self.scheme]
        gate_up = {k: v for k, v in comps.items() if k.startswith("gate_up")}
        down = {k: v for k, v in comps.items() if k.startswith("down")}
        return {**gate_up, "gate_up_bias": (dt, (2 * I,)), **down, "down_bias": (dt, (H,))}

    def expert(self, em: Emitter, e: int) -> dict[str, torch.Tensor]:
        from ft.formats.quant import mxfp4

        p, rows = self.p, (e, e + 1)
        bias_dt = torch.float32 if self.scheme == "mxfp4" else DTYPE_OF[self.scheme]
        out = {"gate_up_bias": em.read(f"{p}gate_up_proj_bias", bias_dt, rows)[0][self.perm],
               "down_bias": em.read(f"{p}down_proj_bias", bias_dt, rows)[0]}
        if not self.mxfp4:  # [in, out] on disk -> [out, in]
            dt = DTYPE_OF[self.scheme]
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
                out[comp] = to_dtype(mxfp4.dequantize(blocks, scales), DTYPE_OF[self.scheme], f"{p}{src}")
        return out
