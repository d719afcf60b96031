"""Where each NVFP4 expert component sits inside one FTW expert record.

An NVFP4 expert bank stores one contiguous record per expert (`stride` bytes, a multiple of 4096); inside it six
components at fixed byte offsets (each a multiple of 256), see the "Expert banks" table of specs/families.md:

    gate_up        u8      [2I, H/2]   two E2M1 codes per byte, element 2j in the low nibble
    gate_up_scale  e4m3    [2I, H/16]  one scale per 16 inputs
    gate_up_scale_2 f32    [2I]        per output row
    down           u8      [H, I/2]
    down_scale     e4m3    [H, I/16]
    down_scale_2   f32     [H]

The GPU kernels, the CPU kernel and the reference all read records through this one description, so a slot in VRAM,
a pinned staging buffer and the mmapped file hold byte-identical records.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

COMPONENTS = ("gate_up", "gate_up_scale", "gate_up_scale_2", "down", "down_scale", "down_scale_2")


@dataclass(frozen=True)
class RecordLayout:
    hidden: int  # H
    inter: int  # I (moe_intermediate_size)
    stride: int  # bytes per record
    off_gate_up: int
    off_gate_up_scale: int
    off_gate_up_scale_2: int
    off_down: int
    off_down_scale: int
    off_down_scale_2: int

    def __post_init__(self) -> None:
        if self.hidden % 32 or self.inter % 32:
            raise ValueError(f"NVFP4 experts need H and I divisible by 32, got H={self.hidden} I={self.inter}")
        for name in COMPONENTS:
            off = getattr(self, "off_" + name)
            if off % 16:
                raise ValueError(f"component {name} offset {off} is not 16-byte aligned")
            if off + self.nbytes(name) > self.stride:
                raise ValueError(f"component {name} [{off}, +{self.nbytes(name)}) overruns "
                                 f"the record ({self.stride} B)")

    def shape(self, name: str) -> tuple[int, ...]:
        return component_shape(name, self.hidden, self.inter)

    def nbytes(self, name: str) -> int:
        return component_nbytes(name, self.hidden, self.inter)

    @functools.cached_property
    def payload_bytes(self) -> int:
        """Bytes of the six components (what a kernel must read), without record padding (read per layer call by
        the schedulers' counters: computed once)."""
        return sum(self.nbytes(c) for c in COMPONENTS)

    def view(self, record: torch.Tensor, name: str) -> torch.Tensor:
        """Typed zero-copy view of one component inside a uint8 record (any device)."""
        off = getattr(self, "off_" + name)
        raw = record[off : off + self.nbytes(name)]
        if name.endswith("_2"):
            raw = raw.view(torch.float32)
        elif name.endswith("_scale"):
            raw = raw.view(torch.float8_e4m3fn)
        return raw.view(self.shape(name))

    @classmethod
    def from_bank(cls, bank, hidden: int, inter: int) -> RecordLayout:
        """Layout of an FTW `ExpertBankView` (scheme must be nvfp4; shapes are checked against H and I)."""
        if bank.scheme != "nvfp4":
            raise ValueError(f"expert bank scheme {bank.scheme!r} is not supported by the NVFP4 kernels")
        comps = bank.components
        missing = [c for c in COMPONENTS if c not in comps]
        if missing:
            raise ValueError(f"nvfp4 expert bank lacks components {missing}")
        layout = cls(hidden, inter, int(bank.stride), *(int(comps[c].offset) for c in COMPONENTS))
        for c in COMPONENTS:
            if tuple(comps[c].shape) != layout.shape(c):
                raise ValueError(f"bank component {c} has shape {tuple(comps[c].shape)}, expected {layout.shape(c)}")
        return layout

    @classmethod
    def packed(cls, hidden: int, inter: int) -> RecordLayout:
        """A layout built like the compiler's: components in table order, 256-aligned, stride a multiple of 4096."""
        offs, pos = [], 0
        for c in COMPONENTS:
            offs.append(pos)
            pos = (pos + component_nbytes(c, hidden, inter) + 255) // 256 * 256
        return cls(hidden, inter, (pos + 4095) // 4096 * 4096, *offs)


def component_shape(name: str, h: int, i: int) -> tuple[int, ...]:
    return {
        "gate_up": (2 * i, h // 2),
        "gate_up_scale": (2 * i, h // 16),
        "gate_up_scale_2": (2 * i,),
        "down": (h, i // 2),
        "down_scale": (h, i // 16),
        "down_scale_2": (h,),
    }[name]


def component_nbytes(name: str, h: int, i: int) -> int:
    n = 1
    for d in component_shape(name, h, i):
        n *= d
    return n * (4 if name.endswith("_2") else 1)
