"""Check a plan against the checkpoint headers before anything is written.

Every source tensor is located and its shape, dtype and encoding checked against the normalized config; each expert
bank's FTW scheme is decided; every checkpoint tensor must be consumed, deliberately skipped (MTP head, vision tower)
or a known quantization side tensor, so nothing is silently dropped. Errors name the tensor and what was expected.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.experts import Bank
from ft.compiler.linear import AUX_SUFFIXES, DtypePolicy, Sniffed, sniff
from ft.compiler.plan import Item, LinearItem, TensorItem
from ft.compiler.quant.modelopt import QuantDecl
from ft.compiler.source import Checkpoint
from ft.formats.layout import ALIGN


@dataclass
class Prepared:
    steps: list[tuple[Item, object]]  # (item, resolved sources: list[Sniffed] | Bank | None)
    consumed: list[str]  # source tensors in first-use order
    read_bytes: int
    out_bytes: int  # data bytes the FTW will hold (+ alignment slack), for the free-space check
    skipped: dict[str, int] = field(default_factory=dict)  # prefix -> tensors skipped
    ignored: dict[str, int] = field(default_factory=dict)  # quant side-tensor suffix -> count

    @property
    def bank_scheme(self) -> str | None:
        return next((bp.scheme for _, bp in self.steps if isinstance(bp, Bank)), None)


def _check_shape(ck: Checkpoint, name: str, want: tuple[int, ...], what: str = "") -> None:
    got = ck.info(name).shape
    if got != tuple(want):
        raise CheckpointError(f"{name}: shape {list(got)} does not match the config's {list(want)}{what}")


def _linear(ck: Checkpoint, decl: QuantDecl, item: LinearItem) -> list[Sniffed]:
    out = []
    for module, rows in item.parts:
        sn = sniff(ck, module)
        if (sn.out_features, sn.in_features) != (rows, item.in_features):
            raise CheckpointError(f"{module}.weight: logical shape [{sn.out_features}, {sn.in_features}] does not "
                                  f"match the config's [{rows}, {item.in_features}]")
        allowed = {"plain"} if item.router else decl.allowed(module)
        if sn.scheme not in allowed:
            raise CheckpointError(f"{module}: stored as {sn.scheme}, but the checkpoint's quantization config "
                                  f"allows {sorted(allowed)} for it")
        if item.bias:
            ck.float_dtype(f"{module}.bias")
            _check_shape(ck, f"{module}.bias", (rows,))
        out.append(sn)
    return out


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def _linear_out_bytes(ck: Checkpoint, sns: list[Sniffed], item: LinearItem, pol: DtypePolicy) -> int:
    """Bytes the linear will occupy in the FTW (the free-space check; over-estimates by at most the bias)."""
    rows, cols = sum(r for _, r in item.parts), item.in_features
    schemes = {sn.scheme for sn in sns}
    if schemes == {"nvfp4"} and not pol.dequant:
        return rows * (cols // 2 + cols // 16 + 4)
    if schemes == {"fp8"} and not pol.dequant:
        return rows * (cols + 4)
    if schemes == {"plain"}:
        dts = {ck.info(f"{sn.module}.weight").torch_dtype for sn in sns}
        dt = dts.pop() if len(dts) == 1 else torch.float32
        dt = dt if item.router or pol.dtype is None else pol.dtype
    else:
        dt = pol.plain
    return rows * (cols + 1) * _itemsize(dt)


def _sources(item: Item, src: object) -> list[str]:
    """The source tensors a step reads, in the order it reads them."""
    if isinstance(item, TensorItem):
        return [item.src]
    if isinstance(item, LinearItem):
        return [n for sn in src for n in (*sn.names, *((f"{sn.module}.bias",) if item.bias else ()))]
    return list(src.names)


def _disk_order(steps: list[tuple[Item, object]], ck: Checkpoint) -> list[tuple[Item, object]]:
    """Steps in the order their first source bytes sit on disk (weight files in name order, then offset).

    The compile reads the checkpoint in one pass, file by file from start to end (`source_pass.py`); a step whose
    source the pass meets long before the step runs is held in memory meanwhile, or dropped and read again. A
    single-file save sorts tensors by name, so `lm_head.weight` (1 GB for a 248k vocabulary) is stored first and the
    layer-by-layer plan would take it last. The FTW's own order is free (regions are found by the index)."""
    files = {p: i for i, p in enumerate(sorted({ck.info(n).path for step in steps for n in _sources(*step)}))}

    def at(step: tuple[Item, object]) -> tuple[int, int]:
        return min((files[i.path], i.begin) for i in map(ck.info, _sources(*step)))

    return sorted(steps, key=at)  # stable: steps sharing a first tensor keep the plan's order


def prepare(items: list[Item], ck: Checkpoint, decl: QuantDecl, pol: DtypePolicy, skip: tuple[str, ...]) -> Prepared:
    steps: list[tuple[Item, object]] = []
    out_bytes = 0
    for item in items:
        if isinstance(item, TensorItem):
            if item.kind != "index":
                ck.float_dtype(item.src)
            _check_shape(ck, item.src, item.shape)
            steps.append((item, None))
            info = ck.info(item.src)
            out_dt = (pol.dtype or info.torch_dtype) if item.kind in ("keep", "conv") else \
                torch.int32 if item.kind == "index" else torch.float32
            out_bytes += info.nbytes // _itemsize(info.torch_dtype) * _itemsize(out_dt) + ALIGN
        elif isinstance(item, LinearItem):
            sns = _linear(ck, decl, item)
            steps.append((item, sns))
            out_bytes += _linear_out_bytes(ck, sns, item, pol) + 4 * ALIGN  # weight, scales, bias: each aligned
        else:
            bank = item.source.resolve(ck, decl, pol, item)
            steps.append((item, bank))
            stride = sum(torch.Size(s).numel() * _itemsize(d) + 256 for d, s in bank.components().values())
            out_bytes += item.num_experts * (stride + ALIGN)
    steps = _disk_order(steps, ck)
    consumed = dict.fromkeys(n for item, src in steps for n in _sources(item, src))
    schemes = sorted({bp.scheme for _, bp in steps if isinstance(bp, Bank)})
    if len(schemes) > 1:
        raise CheckpointError(f"expert banks would mix schemes {schemes} (layers differ in encoding); pass --dequant")
    skipped: Counter[str] = Counter()
    ignored: Counter[str] = Counter()
    unknown = []
    for name in ck.tensors:
        if name in consumed:
            continue
        pre = next((p for p in skip if name.startswith(p)), None)
        aux = next((s for s in AUX_SUFFIXES if name.endswith(s)), None) if decl.quantized else None
        if pre is not None:
            skipped[pre] += 1
        elif aux is not None:
            ignored[aux.lstrip(".")] += 1
        else:
            unknown.append(name)
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(f"{ck.root.name}: tensors the config does not account for: "
                              f"{', '.join(sorted(unknown)[:3])}{more}")
    read_bytes = sum(ck.info(n).nbytes for n in consumed)
    return Prepared(steps, list(consumed), read_bytes, out_bytes, dict(sorted(skipped.items())),
                    dict(sorted(ignored.items())))
