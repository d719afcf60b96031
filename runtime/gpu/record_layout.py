"""Where each expert component sits inside one FTW expert record, and what the expert kernels compute from it.

A quantized expert bank stores one contiguous record per expert (`stride` bytes, a multiple of 4096); inside it six
components at fixed byte offsets (each a multiple of 256), see the "Expert banks" table of specs/families.md:

    nvfp4 (ModelOpt)                                 mxfp4 (gpt-oss)
    gate_up         u8   [2I, H/2]                   gate_up       u8  [2I, H/2]   E2M1 codes, element 2j low nibble
    gate_up_scale   e4m3 [2I, H/16]  per 16 inputs   gate_up_scale u8  [2I, H/32]  E8M0, one per 32 inputs
    gate_up_scale_2 f32  [2I]        per row         gate_up_bias  f32 [2I]
    down            u8   [H, I/2]                    down          u8  [H, I/2]
    down_scale      e4m3 [H, I/16]                   down_scale    u8  [H, I/32]
    down_scale_2    f32  [H]                         down_bias     f32 [H]

The mxfp4 biases are optional as a pair: gpt-oss records carry both, DeepSeek-V4's FP4 experts neither (their offsets
-1, `kernel_args` BIAS false); a record with one bias is refused.

The layout also carries the expert's function, fixed per model: `act` "silu" (`silu(g) * u`), "clamped_swiglu"
(gpt_oss: `(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`, `g' = min(g, limit)`, with the biases added
to g, u and the down projection first) or "clamped_silu" (deepseek_v4: `silu(min(g, limit)) * clamp(u, -limit,
limit)`; `ft.runtime.experts`). `kernel_args` turns format and function into the Triton kernels' constexprs, so
each model compiles one specialisation of each kernel and no call branches on the format.

The GPU kernels, the CPU kernel and the reference all read records through this one description, so a slot in VRAM,
a pinned staging buffer and the mmapped file hold byte-identical records.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

NVFP4_COMPONENTS = ("gate_up", "gate_up_scale", "gate_up_scale_2", "down", "down_scale", "down_scale_2")
MXFP4_COMPONENTS = ("gate_up", "gate_up_scale", "gate_up_bias", "down", "down_scale", "down_bias")
COMPONENTS = NVFP4_COMPONENTS  # the NVFP4 record (benchmarks and tools build NVFP4 records)
SCHEMES = {"nvfp4": NVFP4_COMPONENTS, "mxfp4": MXFP4_COMPONENTS}
BIASES = ("gate_up_bias", "down_bias")  # mxfp4: both or neither
GROUP = {"nvfp4": 16, "mxfp4": 32}  # inputs per block scale
ACTS = ("silu", "clamped_swiglu", "clamped_silu")


@dataclass(frozen=True)
class RecordLayout:
    hidden: int  # H
    inter: int  # I (moe_intermediate_size)
    stride: int  # bytes per record
    off_gate_up: int
    off_gate_up_scale: int
    off_gate_up_scale_2: int  # -1: absent (mxfp4)
    off_down: int
    off_down_scale: int
    off_down_scale_2: int
    off_gate_up_bias: int = -1  # -1: absent (nvfp4)
    off_down_bias: int = -1
    scheme: str = "nvfp4"
    act: str = "silu"
    alpha: float = 1.702  # clamped_swiglu only
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown expert scheme {self.scheme!r}; the GPU kernels take {', '.join(SCHEMES)}")
        if self.act not in ACTS:
            raise ValueError(f"unknown expert activation {self.act!r}; supported: {', '.join(ACTS)}")
        if self.hidden % 32 or self.inter % 32:
            raise ValueError(f"{self.scheme} experts need H and I divisible by 32, got H={self.hidden} I={self.inter}")
        if self.scheme == "mxfp4" and (self.off_gate_up_bias < 0) != (self.off_down_bias < 0):
            raise ValueError("mxfp4 records carry both expert biases or neither, got offsets "
                             f"gate_up_bias {self.off_gate_up_bias}, down_bias {self.off_down_bias}")
        absent = set(NVFP4_COMPONENTS + MXFP4_COMPONENTS) - set(self.components)
        for name in absent:
            if getattr(self, "off_" + name) != -1:
                raise ValueError(f"{self.scheme} records have no component {name} (its offset must be -1)")
        for name in self.components:
            off = getattr(self, "off_" + name)
            if off < 0 or off % 16:
                raise ValueError(f"component {name} offset {off} is not a 16-byte aligned offset")
            if off + self.nbytes(name) > self.stride:
                raise ValueError(f"component {name} [{off}, +{self.nbytes(name)}) overruns "
                                 f"the record ({self.stride} B)")

    @property
    def components(self) -> tuple[str, ...]:
        """The record's components in table order (mxfp4 without biases: four)."""
        if self.scheme == "mxfp4" and self.off_down_bias < 0:
            return tuple(c for c in MXFP4_COMPONENTS if c not in BIASES)
        return SCHEMES[self.scheme]

    @property
    def group(self) -> int:
        return GROUP[self.scheme]

    def shape(self, name: str) -> tuple[int, ...]:
        return component_shape(name, self.hidden, self.inter, self.group)

    def nbytes(self, name: str) -> int:
        return component_nbytes(name, self.hidden, self.inter, self.group)

    @functools.cached_property
    def payload_bytes(self) -> int:
        """Bytes of the components (what a kernel must read), without record padding (read per layer call by
        the schedulers' counters: computed once)."""
        return sum(self.nbytes(c) for c in self.components)

    @functools.cached_property
    def extent(self) -> int:
        """Bytes from the record's start to the end of its last component (what a whole-record read touches)."""
        return max(getattr(self, "off_" + c) + self.nbytes(c) for c in self.components)

    def kernel_args(self, which: str) -> dict:
        """Keyword arguments of the `which` ("gate_up" or "down") expert kernels: the optional components' offsets
        (0 where absent: never read) and the format and activation constexprs. GPS: 16-element code words per block
        scale; E8M0: E8M0 scales (else e4m3); S2: a per-row second-level scale; BIAS: per-row biases; SWIGLU (gate_up
        kernels only): the clamped SwiGLU with ALPHA, LIMIT, else silu, of g and u clamped at LIMIT when LIMIT > 0."""
        common = {"GPS": self.group // 16, "E8M0": self.scheme == "mxfp4", "S2": self.off_down_scale_2 >= 0,
                  "BIAS": self.off_down_bias >= 0}
        if which == "down":
            return {"OFF_DS2": max(self.off_down_scale_2, 0), "OFF_DB": max(self.off_down_bias, 0), **common}
        if which != "gate_up":
            raise ValueError(f"unknown expert kernel {which!r}; expected gate_up or down")
        swiglu = self.act == "clamped_swiglu"
        return {"OFF_GUS2": max(self.off_gate_up_scale_2, 0), "OFF_GUB": max(self.off_gate_up_bias, 0), **common,
                "SWIGLU": swiglu, "ALPHA": float(self.alpha) if swiglu else 0.0,
                "LIMIT": float(self.limit) if self.act != "silu" else 0.0}

    def view(self, record: torch.Tensor, name: str) -> torch.Tensor:
        """Typed zero-copy view of one component inside a uint8 record (any device)."""
        if name not in self.components:
            raise KeyError(f"{self.scheme} records have no component {name!r}")
        off = getattr(self, "off_" + name)
        raw = record[off : off + self.nbytes(name)]
        if name.endswith(("_2", "_bias")):
            raw = raw.view(torch.float32)
        elif name.endswith("_scale") and self.scheme == "nvfp4":
            raw = raw.view(torch.float8_e4m3fn)
        return raw.view(self.shape(name))

    @classmethod
    def from_bank(cls, bank, hidden: int, inter: int, *, act: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0) -> RecordLayout:
        """Layout of an FTW `ExpertBankView` (nvfp4 or mxfp4; shapes are checked against H and I)."""
        if bank.scheme not in SCHEMES:
            raise ValueError(f"expert bank scheme {bank.scheme!r} has no GPU kernel (supported: {', '.join(SCHEMES)})")
        comps, names = bank.components, SCHEMES[bank.scheme]
        if bank.scheme == "mxfp4" and not any(b in comps for b in BIASES):
            names = tuple(c for c in names if c not in BIASES)  # DeepSeek-V4's FP4 experts: no biases
        missing = [c for c in names if c not in comps]
        if missing:
            raise ValueError(f"{bank.scheme} expert bank lacks components {missing}")
        extra = sorted(set(comps) - set(names))
        if extra:
            raise ValueError(f"{bank.scheme} expert bank has components {extra} the record layout does not know")
        offs = {f"off_{c}": int(comps[c].offset) for c in names}
        layout = cls(**{"off_gate_up_scale_2": -1, "off_down_scale_2": -1, **offs}, hidden=hidden, inter=inter,
                     stride=int(bank.stride), scheme=bank.scheme, act=act, alpha=alpha, limit=limit)
        for c in names:
            if tuple(comps[c].shape) != layout.shape(c):
                raise ValueError(f"bank component {c} has shape {tuple(comps[c].shape)}, expected {layout.shape(c)}")
        return layout

    @classmethod
    def for_model(cls, bank, config) -> RecordLayout:
        """`from_bank` with the sizes and the expert activation of a `ModelConfig`."""
        return cls.from_bank(bank, config.hidden_size, config.moe_intermediate_size, act=config.expert_act,
                             alpha=config.swiglu_alpha, limit=config.swiglu_limit)

    @classmethod
    def packed(cls, hidden: int, inter: int, scheme: str = "nvfp4", *, act: str = "silu", alpha: float = 1.702,
               limit: float = 7.0, bias: bool = True) -> RecordLayout:
        """A layout built like the compiler's: components in table order, 256-aligned, stride a multiple of 4096
        (`bias`: mxfp4 records with the expert biases, gpt-oss's, or without, DeepSeek-V4's)."""
        if scheme not in SCHEMES:
            raise ValueError(f"unknown expert scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
        offs, pos = {"off_gate_up_scale_2": -1, "off_down_scale_2": -1}, 0
        for c in SCHEMES[scheme]:
            if c in BIASES and not bias:
                continue
            offs["off_" + c] = pos
            pos = (pos + component_nbytes(c, hidden, inter, GROUP[scheme]) + 255) // 256 * 256
        return cls(hidden=hidden, inter=inter, stride=(pos + 4095) // 4096 * 4096, scheme=scheme, act=act,
                   alpha=alpha, limit=limit, **offs)


def component_shape(name: str, h: int, i: int, group: int = 16) -> tuple[int, ...]:
    return {
        "gate_up": (2 * i, h // 2),
        "gate_up_scale": (2 * i, h // group),
        "gate_up_scale_2": (2 * i,),
        "gate_up_bias": (2 * i,),
        "down": (h, i // 2),
        "down_scale": (h, i // group),
        "down_scale_2": (h,),
        "down_bias": (h,),
    }[name]


def component_nbytes(name: str, h: int, i: int, group: int = 16) -> int:
    n = 1
    for d in component_shape(name, h, i, group):
        n *= d
    return n * (4 if name.endswith(("_2", "_bias")) else 1)
