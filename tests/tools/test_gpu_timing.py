"""tools/gpu_timing.py's host description (the GPU helpers need CUDA and run on the GPU machine only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_timing  # noqa: E402


def test_host_cpu_counts_the_cpus_this_process_may_use():
    host = gpu_timing.host_cpu()
    assert host["cpus"] == len(os.sched_getaffinity(0))
    assert 1 <= host["physical_cores"] <= host["cpus"]  # SMT siblings share a core: never more cores than CPUs
    assert host["numa_nodes"] >= 0 and isinstance(host["model"], str)


def test_host_cpu_folds_smt_siblings(monkeypatch, tmp_path):
    """Two CPUs on one core (siblings) count as one physical core."""
    for cpu, core in ((0, 0), (1, 0)):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    real = gpu_timing.Path

    def fake(p):
        p = str(p)
        return real(p.replace("/sys/devices/system/cpu", str(tmp_path))) if p.startswith("/sys/devices/system/cpu") \
            else real(p)

    monkeypatch.setattr(gpu_timing, "Path", fake)
    monkeypatch.setattr(gpu_timing.os, "sched_getaffinity", lambda _: {0, 1})
    assert gpu_timing.host_cpu()["physical_cores"] == 1 and gpu_timing.host_cpu()["cpus"] == 2
