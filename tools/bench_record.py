"""Shared bits of the CPU benchmark scripts: a one-line machine description and the run log under benchmarks/."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    return cpu


def machine(extra: str = "") -> str:
    """CPU model, cores, Python and the 1-minute load average (the cores may be shared), plus `extra`."""
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, " \
           f"{extra + ', ' if extra else ''}1-min load {load}"


def host_cpu() -> dict:
    """The host as the GPU path's CPU lane sees it: CPU model, the CPUs this process may run on, how many distinct
    physical cores they are (fewer: SMT siblings, which share a core's load ports) and NUMA nodes. The lane runs all
    CPUs but two."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    return {"model": cpu_model(), "cpus": len(cpus), "physical_cores": len(cores), "numa_nodes": nodes}


def append_run(out: Path, stem: str, run: dict) -> list[dict]:
    """Append `run` to <out>/<stem>.json (a list of runs) and return all runs, oldest first."""
    path = Path(out) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(run)
    path.write_text(json.dumps(runs, indent=1) + "\n")
    return runs
