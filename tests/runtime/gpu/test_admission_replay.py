"""tools/belady.py's replay of mode mapped (`replay_mapped`) is the engine's cache: on the CPU emulation (uploads land
at once) it reproduces the engine's hits, misses and admissions call for call, so admission policies can be studied
offline on the routing traces tools/gpu_full.py saves, against Belady's MIN on the same trace."""

from __future__ import annotations

import pytest
import torch

from belady import (belady, load_trace, replay_mapped, save_trace,  # tools/ (put on the path by conftest)
                    static_from_history, static_oracle)
from ft.formats import FtwReader
from ft.runtime.gpu.offload_config import OffloadConfig
from ft.runtime.gpu.store import GpuExperts

from .gpu_fixtures import tiny_moe_ftw

E, K, L, S = 16, 2, 3, 5
SKEW = torch.tensor([8.0, 4, 4, 2, 2] + [1.0] * 11)


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return FtwReader(tiny_moe_ftw(tmp_path_factory.mktemp("replay") / "m.ftw", experts=E, top_k=K, hidden=64))


@pytest.mark.parametrize("admit_max,margin", [(1, 2.0), (2, 1.0), (2, 0.0)])
def test_replay_reproduces_the_engine(reader, tmp_path, admit_max, margin):
    opts = OffloadConfig(num_slots=S, admit_max=admit_max, admit_margin=margin, trace_limit=10_000)
    ex = GpuExperts(reader, opts, device="cpu", device_plan=True)
    g = torch.Generator().manual_seed(3)
    for i in range(300):
        ids = torch.multinomial(SKEW, K, generator=g)[None]
        ex(i % L, torch.randn(1, 64, generator=g).to(torch.bfloat16), ids, torch.rand(1, K, generator=g))
    ex.settle()
    s = ex.stats()
    save_trace(tmp_path / "t.jsonl", ex.trace)  # through the file format tools/gpu_full.py writes
    trace = load_trace(tmp_path / "t.jsonl")
    r = replay_mapped(trace, L, E, S, admit_max=admit_max, admit_margin=margin)
    assert (r["hits"], r["misses"], r["admitted"]) == (s["hits"], s["misses"], s["fetched"]) and r["admitted"] > 0
    assert belady(trace, E, S)["hits"] >= r["hits"]
    ex.close()


def test_static_oracle_holds_the_most_routed_experts():
    import numpy as np

    trace = [(0, np.array([1, 2])), (1, np.array([1])), (0, np.array([1, 3])), (0, np.array([2, 1]))]
    # flat ids (layer * 4 + expert): 1 three times, 2 twice, 5 and 3 once: two slots hold 1 and 2
    assert static_oracle(trace, 4, 2) == {"accesses": 7, "hits": 5, "misses": 2, "admitted": 2}
    assert static_oracle(trace, 4, 1, count_from=2)["hits"] == 2  # steps 2 and 3 only: expert 1 of layer 0


def test_the_history_set_is_chosen_before_the_counted_steps_and_scored_on_them():
    import numpy as np

    trace = [(0, np.array([1, 2])), (0, np.array([1])), (0, np.array([2, 3])), (0, np.array([3])), (0, np.array([3]))]
    # before step 2: expert 1 twice, 2 once -> one slot holds 1, which steps 2-4 never route (static_oracle: 3)
    assert static_from_history(trace, 4, 1, count_from=2) == {"accesses": 4, "hits": 0, "misses": 4, "admitted": 1}
    assert static_oracle(trace, 4, 1, count_from=2)["hits"] == 3
    assert static_from_history(trace, 4, 2, count_from=2)["hits"] == 1  # 1 and 2 held: step 2's expert 2
