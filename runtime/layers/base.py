"""The runtime's tiny module tree: attribute names are FTW tensor names.

An `Op` is a plain object. Its public attributes are either weights (tensors, or the `REQUIRED` marker until the
loader binds them), child `Op`s, or lists of child `Op`s. Attributes starting with `_` are configuration and are never
walked. The loader resolves an FTW name such as `layers.3.self_attn.qkv_proj.weight` by walking attributes (list
indices for the numeric parts) and assigns the tensor to the last one, so there is no rename table.

Optional weights (a bias that only some families have, the scale siblings of a quantized linear) are declared by
listing their names in the class attribute `optional`; they stay `None` unless the FTW holds them. Attributes listed
in `banks` are bound to FTW expert banks, never to tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


class _Required:
    """Marker for a weight the FTW must provide (replaced by a tensor at load)."""

    _instance: _Required | None = None

    def __new__(cls) -> _Required:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class Op:
    """Base class of runtime blocks (see the module docstring)."""

    optional: tuple[str, ...] = ()
    banks: tuple[str, ...] = ()
    # Fused Triton kernels instead of the PyTorch ops (decided once at load: `CausalLM.prepare` sets it on every op
    # of a model on CUDA; tests set it on CPU under TRITON_INTERPRET=1). The PyTorch ops stay the reference.
    _fused: bool = False

    def __init__(self) -> None:
        for name in self.optional:
            setattr(self, name, None)

    def children(self) -> Iterator[tuple[str, Op]]:
        """Direct child ops as (relative name, op); list members are named by their index."""
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, Op):
                yield name, value
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, Op):
                        yield f"{name}.{i}", item

    def named_ops(self, prefix: str = "") -> Iterator[tuple[str, Op]]:
        """This op and all descendants, depth first, as (full dotted name, op)."""
        yield prefix, self
        for name, child in self.children():
            yield from child.named_ops(f"{prefix}.{name}" if prefix else name)

    def weight_slots(self) -> Iterator[str]:
        """Names of this op's own weight attributes (bound, required or declared optional)."""
        for name, value in vars(self).items():
            if name.startswith("_") or name in self.banks:
                continue
            if value is REQUIRED or isinstance(value, torch.Tensor) or name in self.optional:
                yield name

    def missing(self, prefix: str = "") -> list[str]:
        """Full names of required weights that were never bound."""
        out = []
        for path, op in self.named_ops(prefix):
            for name, value in vars(op).items():
                if value is REQUIRED:
                    out.append(f"{path}.{name}" if path else name)
        return out

    def map_weights(self, fn: Callable[[str, torch.Tensor], torch.Tensor], prefix: str = "") -> None:
        """Replace every bound tensor `t` (full name `n`) by `fn(n, t)`, e.g. to move it to a device."""
        for path, op in self.named_ops(prefix):
            for name in list(op.weight_slots()):
                value = getattr(op, name)
                if isinstance(value, torch.Tensor):
                    setattr(op, name, fn(f"{path}.{name}" if path else name, value))


def place(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` on `device`, cast where it is before it moves: a copy to the GPU with a cast would stage the
    source dtype on the device (an fp32 temporary per dequantized weight), and each freed temporary leaves a hole in
    the caching allocator's segments that later, larger allocations cannot use; it also halves the bytes copied."""
    if t.device.type == "cpu" and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device=device, dtype=dtype)


def resolve_slot(root: Op, name: str, *, bank: bool = False) -> tuple[Op, str]:
    """Walk `name` (`a.b.3.c.weight`) from `root`; return (owning op, attribute). Raises KeyError if any part of the
    path is not declared by the module tree as a weight (or, with `bank=True`, as an expert-bank slot)."""
    parts = name.split(".")
    obj: Any = root
    for part in parts[:-1]:
        if isinstance(obj, list):
            if not part.isdigit() or int(part) >= len(obj):
                raise KeyError(name)
            obj = obj[int(part)]
        elif isinstance(obj, Op) and not part.startswith("_") and hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise KeyError(name)
    last = parts[-1]
    if not isinstance(obj, Op) or last.startswith("_"):
        raise KeyError(name)
    if last not in (obj.banks if bank else set(obj.weight_slots())):
        raise KeyError(name)
    return obj, last
