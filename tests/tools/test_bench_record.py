"""tools/bench_record.py's machine description: the host CPU the GPU benchmarks record beside their numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_record  # noqa: E402


def test_host_cpu_counts_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(bench_record.os, "sched_getaffinity", lambda _: {0, 3, 5})
    host = bench_record.host_cpu()
    assert host["cpus"] == 3 and host["model"] == bench_record.cpu_model()


@pytest.mark.parametrize("topology,cores", [
    ({0: (0, 0), 1: (0, 0)}, 1),           # SMT siblings: one core
    ({0: (0, 0), 1: (0, 1)}, 2),           # two cores of one package
    ({0: (0, 0), 1: (1, 0)}, 2),           # the same core id on two packages
    ({0: (0, 0), 1: None}, 2),             # a CPU whose topology cannot be read counts as its own core
])
def test_host_cpu_counts_physical_cores_from_the_topology(monkeypatch, tmp_path, topology, cores):
    for cpu, where in topology.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        if where is not None:
            (topo / "physical_package_id").write_text(f"{where[0]}\n")
            (topo / "core_id").write_text(f"{where[1]}\n")
    real = bench_record.Path

    def fake(p):
        p = str(p)
        return real(p.replace("/sys/devices/system/cpu", str(tmp_path), 1)) if p.startswith(
            "/sys/devices/system/cpu") else real(p)

    monkeypatch.setattr(bench_record, "Path", fake)
    monkeypatch.setattr(bench_record.os, "sched_getaffinity", lambda _: set(topology))
    host = bench_record.host_cpu()
    assert host["physical_cores"] == cores and host["cpus"] == len(topology)
