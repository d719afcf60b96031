"""Register, spill and shared-memory use of every Triton kernel the runtime launches for a model, compiled for
sm_<ARCH> on a machine without a GPU (the launches and the stand-in driver of `ft.compiler.kernels`).

    python tools/compile_sm90.py --ftw DIR [--arch 90] [--only fused,moe] [--max-prefill-length 4096]

DIR is any FTW of the geometry to study: a compiled model, or a full-size one cut to two layers by
`ft synth --preset qwen3.6-35b-a3b --layers 2 --quant nvfp4` + `ft checkpoint` (tools/gpu_full.py's "models" stage
makes the full ones). Prints one line per distinct compiled kernel: registers, stack (spill) bytes, shared memory;
then the kernels that failed to build; exits 1 if any failed. `ft kernels build` stores the same kernels in the FTW.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: kernels must be JITFunctions

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import triton  # noqa: E402

from ft.compiler.kernels import launches  # noqa: E402
from ft.compiler.kernels.stand_in import cuda_target  # noqa: E402
from ft.formats import FtwReader  # noqa: E402


def usage(kernel) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    use = {key: int(v) for key, v in re.findall(r"(REG|STACK):(\d+)", res)}
    return f"regs={use.get('REG')} stack={use.get('STACK')} shared={kernel.metadata.shared}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ftw", required=True, help="FTW directory of the geometry to build for")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", default=",".join(launches.GROUPS), help="kernel groups: " + ", ".join(launches.GROUPS))
    ap.add_argument("--max-prefill-length", type=int, default=4096)
    args = ap.parse_args(argv)
    reader = FtwReader(args.ftw, checksums="off")
    g, lengths = launches.geometry(reader), launches.prefill_lengths(args.max_prefill_length)
    print(f"triton {triton.__version__}, target sm_{args.arch}, {args.ftw}")

    def show(b) -> None:
        src = b.kernel.src
        names = lambda k: src.fn.arg_names[k[0]] if isinstance(k, tuple) else k  # noqa: E731 - (index,) -> name
        shown = ",".join(f"{names(k)}={v}" for k, v in (getattr(src, "constants", {}) or {}).items()
                         if isinstance(v, (int, float, bool, str)))
        print(f"{b.name:28s} {b.case:10s} {usage(b.kernel)}   [{shown}]", flush=True)

    with cuda_target(args.arch, on_kernel=show) as rec:
        for group in args.only.split(","):
            rec.case = group
            try:
                launches.GROUPS[group](g, lengths)
            except Exception as e:  # noqa: BLE001 - a launcher that fails on the host: report, go on
                rec.errors[(group,)] = f"<{group} launcher>: {type(e).__name__}: {e}"[:300]
    for err in rec.errors.values():
        print(f"ERROR {err}")
    spills = [b for b in rec.built.values() if "stack=0" not in usage(b.kernel)]
    print(f"{len(rec.built)} kernels built, {len(rec.errors)} failed, {len(spills)} with stack (spill) bytes")
    return 1 if rec.errors else 0


if __name__ == "__main__":
    sys.exit(main())
