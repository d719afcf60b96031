"""Shared bits of the CPU benchmark scripts: a one-line machine description and the run log under benchmarks/."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine(extra: str = "") -> str:
    """CPU model, cores, Python and the 1-minute load average (the cores may be shared), plus `extra`."""
    cpu, load = platform.processor() or platform.machine(), "?"
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    if Path("/proc/loadavg").exists():
        load = Path("/proc/loadavg").read_text().split()[0]
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {extra + ', ' if extra else ''}" \
           f"1-min load {load}"


def append_run(out: Path, stem: str, run: dict) -> list[dict]:
    """Append `run` to <out>/<stem>.json (a list of runs) and return all runs, oldest first."""
    path = Path(out) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(run)
    path.write_text(json.dumps(runs, indent=1) + "\n")
    return runs
