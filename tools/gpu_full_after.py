"""The tools tools/gpu_full.py runs on a model's FTW after that model's rows (`--after TOOL[@MODEL]`), each in its own
process with what is left of the call's deadline."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

# tools that run on a model's FTW after its rows (the FTW is deleted before the next model: one full size at a time)
# plan: `ft plan` for this machine from 256 calibration tokens, written into the FTW (before coldstart, whose server
# then starts from it, as issue 16's cold starts do); coldstart: kernels built, page cache dropped, the start with
# them only (the JIT start has its rows in coldstart.md), every thread profiled where py-spy is on the PATH
# (tools/gpu_run.sh puts the carried wheel's binary there)
AFTER = {"plan": ["-c", "from ft.cli.main import main; main()", "plan", "--vram-budget", "8GiB", "--calibrate", "256"],
         "coldstart": ["tools/bench_coldstart.py", "--build", "--drop-caches", "--vram-budget", "8GiB", "--modes",
                       "prebuilt"],
         "agent_replay": ["tools/bench_agent_replay.py", "--device", "cuda", "--vram-budget", "8GiB", "--skip-off"],
         "prefix_host": ["tools/bench_prefix_host.py", "--device", "cuda", "--vram-budget", "8GiB"],
         "soak": ["tools/campaign_soak.py", "--device", "cuda", "--vram-budget", "8GiB"],
         "startup": ["tools/profile_startup.py", "--device", "cuda", "--vram-budget", "8GiB"]}


def run_after(tool: str, ftw: Path, out: Path, left: float, log) -> dict:
    """One of AFTER on `ftw`, its results in `out`, its log in <out>/log.txt; it gets what is left of the deadline
    (the soak runs for that long, less a minute for its start and its report); `log` prints a line."""
    cmd = [sys.executable, *AFTER[tool], "--ftw", str(ftw)] + ([] if tool == "plan" else ["--out", str(out)])
    if "--vram-budget" in cmd:  # the tool's budget counts what the device holds at its start: this process's too
        from ft.runtime.gpu.sizing import parse_bytes

        i = cmd.index("--vram-budget") + 1
        cmd[i] = str(parse_bytes(cmd[i]) + held_by_this_process())
    if tool == "coldstart":
        cmd += ["--deadline", str(max(30.0, (left - 30) / 4))]
        if spy := shutil.which("py-spy"):
            cmd += ["--py-spy", spy]
    elif tool == "soak":
        cmd += ["--minutes", f"{max(1.0, (left - 90) / 60):.1f}"]
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=left - 15)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out", None
    text = text if isinstance(text, str) else text.decode(errors="replace")
    (out / "log.txt").write_text(text)
    tail = text.strip().splitlines()[-8:]
    log(f"{tool}: rc {rc} in {time.perf_counter() - t:.0f} s\n    " + "\n    ".join(tail))
    return {"command": " ".join(cmd), "returncode": rc, "seconds": time.perf_counter() - t, "tail": tail}


def held_by_this_process() -> int:
    """Device bytes this process still holds once its cached blocks are freed (its CUDA context, kernels, what is
    still referenced), all that the device holds on this dedicated machine: an after-tool's start-up counts it as in
    use, so its budget is raised by as much and the tool itself gets the budget named in AFTER."""
    import gc

    if not torch.cuda.is_available():
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free
