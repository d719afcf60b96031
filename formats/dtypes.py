"""Element types and quantization scheme ids of FTW v1 (specs/ftw.md, "Types").

Names are the normative ids in the manifest. Numbers are listed for reference and for binary
side formats; a retired id (name or number) is never reused.
"""

from __future__ import annotations

import math

import torch

# name -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
}
_BY_TORCH = {dt: name for name, (dt, _) in DTYPES.items()}
# dtype name -> stable number (for binary side formats such as plans/ and kernels/ entries)
DTYPE_IDS: dict[str, int] = {"F32": 1, "F16": 2, "BF16": 3, "F8_E4M3": 4, "U8": 5, "I8": 6, "I32": 7, "I64": 8}
RETIRED_DTYPES: dict[str, int] = {}
assert DTYPE_IDS.keys() == DTYPES.keys()

# scheme name -> stable number. Schemes describe how a linear's or expert's weights are encoded.
SCHEMES: dict[str, int] = {
    "fp32": 1,
    "fp16": 2,
    "bf16": 3,
    "nvfp4": 4,  # ModelOpt NVFP4: E2M1 codes, e4m3 scale per 16 inputs, fp32 scale_2 per output row
    "mxfp4": 5,  # OCP MXFP4 expert banks: gpt-oss (with biases), DeepSeek-V4's FP4 experts (without)
    "fp8_block": 6,  # reserved for DeepSeek-style 128x128 block FP8
    "fp8_row": 7,  # e4m3 weights, fp32 scale per output row
}
RETIRED_SCHEMES: dict[str, int] = {}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no FTW id; supported: {sorted(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name][0]


def itemsize(name: str) -> int:
    return DTYPES[name][1]


def nbytes_of(name: str, shape: list[int] | tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[name][1]
