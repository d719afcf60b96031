"""Campaign: `ft checkpoint` killed with SIGKILL at random points, then rerun; each rerun must be byte-identical.

    python tools/campaign_kill.py --out DIR [--kills 20] [--preset small] [--seed 0]

Synthesizes one checkpoint (`ft synth`), compiles it once for the reference (every output file's xxh3), then N times:
start `ft checkpoint --model HF --out OUT_i`, SIGKILL it after a random share of the reference compile's wall time,
record what a reader finds at OUT_i (nothing; refused, naming the rule; or a complete FTW that passes `verify`, every
checksum included: a kill after the final rename), rerun the same command to completion and compare every file with
the reference. Writes DIR/campaign_kill.json and prints a summary; exits 1 if any rerun fails or differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]


def digests(ftw: Path) -> dict[str, str]:
    """Relative path -> xxh3 of every file under `ftw`."""
    from ft.formats.layout import xxh3_hex

    return {str(p.relative_to(ftw)): xxh3_hex(p.read_bytes()) for p in sorted(ftw.rglob("*")) if p.is_file()}


def state(out: Path) -> str:
    """What a reader finds at a killed compile's output path."""
    from ft.formats import FtwError, FtwReader

    if not out.exists():
        return "absent"
    try:
        problems = FtwReader(out).verify()  # structure at open (raises), then every checksum and padding byte
    except FtwError as e:
        return f"refused ({e.rule})"
    return f"refused ({problems[0].rule})" if problems else "complete"


def compile_cmd(hf: Path, out: Path) -> list[str]:
    return FT + ["checkpoint", "--model", str(hf), "--out", str(out), "--no-progress"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf = work / "hf"
        subprocess.run(FT + ["synth", "--arch", "qwen3_moe", "--preset", args.preset, "--out", str(hf)], check=True,
                       capture_output=True)
        t = time.perf_counter()
        subprocess.run(compile_cmd(hf, work / "ref.ftw"), check=True, capture_output=True)
        ref_s = time.perf_counter() - t
        ref = digests(work / "ref.ftw")
        runs = []
        for i in range(args.kills):
            out = work / f"run{i}.ftw"
            delay = rng.uniform(0.05, 1.1) * ref_s  # past the end sometimes: a kill after the final rename
            proc = subprocess.Popen(compile_cmd(hf, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            killed = proc.poll() is None
            if killed:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            found = state(out)
            rerun = subprocess.run(compile_cmd(hf, out) + ["--force"], capture_output=True, text=True)
            same = rerun.returncode == 0 and digests(out) == ref
            runs.append({"kill_at_s": round(delay, 3), "killed": killed, "found": found,
                         "rerun_rc": rerun.returncode, "rerun_identical": same,
                         **({"rerun_stderr": rerun.stderr[-500:]} if rerun.returncode else {})})
            print(f"kill {i:2d} at {delay:6.2f} s ({'killed' if killed else 'already done'}): {found}; rerun "
                  f"{'identical' if same else 'DIFFERENT'}", flush=True)
    bad = [r for r in runs if not r["rerun_identical"]]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "preset": args.preset, "reference_compile_s": round(ref_s, 2), "files": len(ref),
              "kills": sum(r["killed"] for r in runs), "runs": runs, "failures": len(bad)}
    (args.out / "campaign_kill.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['kills']} kills of {len(runs)} runs, {len(bad)} failures; reference compile {ref_s:.1f} s, "
          f"{len(ref)} files")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
