"""The GPU's gather of embedding rows from a page-locked host table (`gpu/kernels/embedding.py`), and the model's
Embedding on top of it. On CPU machines the kernel runs in Triton's interpreter, where a host address is valid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ft.runtime.gpu.kernels.embedding import BLOCK, gather_rows

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [64, BLOCK + 6])  # one block, and a second, partial one
def test_rows_equal_f_embedding(dtype, H):
    g = torch.Generator().manual_seed(H)
    table = torch.randn(50, H, generator=g).to(dtype)
    ids = torch.tensor([3, 0, 49, 3, 17])
    dev = "cuda" if CUDA else "cpu"
    host = table.pin_memory() if CUDA else table
    out = torch.full((len(ids), H), float("nan"), dtype=dtype, device=dev)
    got = gather_rows(host.data_ptr(), ids.to(dev), out)
    assert got is out and torch.equal(got.cpu(), F.embedding(ids, table))  # bit-exact copies
    assert gather_rows(host.data_ptr(), ids[:0].to(dev), out[:0]).shape == (0, H)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_model_embedding_takes_host_or_device_ids():
    from ft.runtime.model import Embedding

    emb = Embedding()
    emb.weight = torch.randn(300, 96).to(torch.bfloat16)
    emb.keep_on_host(torch.device("cuda"))
    assert emb._address is not None and emb.weight.is_pinned()
    ids = torch.tensor([5, 299, 0])
    want = F.embedding(ids, emb.weight)
    assert torch.equal(emb(ids).cpu(), want) and torch.equal(emb(ids.cuda()).cpu(), want)
