"""Fixtures the compiler tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _logits(ftw: Path, n: int = 48) -> torch.Tensor:
    """fp32 logits [n, V] of the compiled model at `ftw` for n seeded random token ids (one prefill)."""
    from ft.runtime.model import Segment, load_model

    model = load_model(ftw)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    state = model.new_state(n)
    [out] = model.forward(ids, [Segment(state, n, "all")])
    return out.float()


@pytest.fixture(scope="session")
def ftw_logits():
    """`ftw_logits(ftw) -> fp32 [48, V]`: what the compiled model predicts for a fixed random prompt."""
    return _logits
