"""Embedding rows gathered by the GPU straight from a page-locked host table.

An untied embedding table stays in host memory on a CUDA model (`ft.runtime.model.Embedding`): V x H bf16 is
0.6-0.95 GiB that an 8 GiB card would rather spend on experts, and a step needs only N of its rows. `map_table`
copies it once into page-locked memory, which the GPU can address (unified addressing); `gather_rows` then reads
the N rows in one kernel over the bus (N x H x 2 bytes: 4 KiB per decode token). The ids may already be on the
device, so a decode step whose token ids were sampled on the GPU embeds them without the host ever seeing them
(`ft.runtime.engine`'s steps in flight), and the gather can be part of a captured CUDA graph.

    gather_rows(table_address, ids [N] int on the device, out [N, H]) -> out, out[i] = table[ids[i]]
Rows move as 16- or 32-bit words (the element size); ids are not range-checked here (the model checks host ids;
device ids come from the sampler, which only produces ids < V).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ft.runtime.gpu.kernels.pdl import pdl_args, pdl_wait

log = logging.getLogger("ft.gpu")
BLOCK = 1024  # words per program


@triton.jit
def _gather_kernel(table, ids, out, H, BYTES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # program (row i, block b): out[i, b BLOCK : (b + 1) BLOCK] = table[ids[i], same columns]; table is an int64
    # address (host memory mapped into the GPU's address space), out a device tensor of the same word type.
    pdl_wait(PDL)
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    tok = tl.load(ids + i).to(tl.int64)
    src = (table + (tok * H + cols) * BYTES).to(tl.pointer_type(out.dtype.element_ty))
    tl.store(out + i.to(tl.int64) * H + cols, tl.load(src, mask=mask), mask=mask)


_WORDS = {2: torch.int16, 4: torch.int32}


def gather_rows(table_address: int, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [N, H] (contiguous, 2- or 4-byte elements) <- rows ids [N] of the [V, H] table at `table_address`."""
    N, H = out.shape
    if N:
        word = _WORDS[out.element_size()]
        _gather_kernel[(N, triton.cdiv(H, BLOCK))](table_address, ids, out.view(word), H,
                                                   BYTES=out.element_size(), BLOCK=BLOCK, **pdl_args(out.device))
    return out


def map_table(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(page-locked copy of `weight`, its device address), or None when page-locking is refused (a pin quota) or the
    address cannot be had; the caller then gathers on the host."""
    from ..pinning import device_pointer

    try:
        pinned = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
    except RuntimeError as e:
        log.warning("page-locking the embedding table (%.2f GiB) was refused (%s): its rows are gathered on the "
                    "host and decode steps are not captured", weight.numel() * weight.element_size() / 2**30, e)
        return None
    pinned.copy_(weight)
    address = device_pointer(pinned.data_ptr())
    if address is None:
        log.warning("the page-locked embedding table has no device address: its rows are gathered on the host")
        return None
    return pinned, address
