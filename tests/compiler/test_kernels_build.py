"""`ft kernels build` for real, on the CPU: Triton's CUDA backend and ptxas compile the runtime's kernels for sm_90
without a GPU. Then a fresh process with an empty Triton cache installs them (`use_prebuilt`) and replays the same
launches: every one loads from the cache, none compiles. Runs in subprocesses without TRITON_INTERPRET (the tests
of ft.runtime.gpu set it for the whole session, and interpreted kernels cannot be compiled).

The build covers the kernel groups other than `moe` with prefill chunks up to 32 tokens (about 15 s on two cores);
the moe group alone adds some 30 s here and is built in the GPU test (tests/runtime/gpu/test_prebuilt_kernels.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GROUPS = "fused,router,attention,deltanet,dense,embedding"
FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]

REPLAY = """
import json, sys
from triton import knobs
from ft.formats import FtwReader
from ft.runtime.gpu.prebuilt import use_prebuilt
from ft.compiler.kernels import launches
from ft.compiler.kernels.stand_in import cuda_target
ftw, cache, groups, lengths = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
knobs.cache.dir = cache
r = FtwReader(ftw)
status = use_prebuilt(r, 90)
g = launches.geometry(r)
with cuda_target(90, cache_dir=cache) as rec:
    for name in groups:
        launches.GROUPS[name](g, launches.prefill_lengths(lengths))
print(json.dumps({"decision": status.decision, "installed": status.installed, "stale": status.stale,
                  "compiled": status.counter.compiled, "hits": status.counter.hits, "names": status.counter.names,
                  "errors": list(rec.errors.values()), "message": status.message}))
"""


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FT_HOME"] = str(tmp_path / "home")
    return env


def test_build_stores_trusted_cubins_that_a_fresh_process_loads_without_compiling(ftw_for, tmp_path):
    # imported here, not at collection: triton must first see the interpreter setting of tests/runtime/gpu
    pytest.importorskip("triton.backends.nvidia.compiler")
    ftw = tmp_path / "m"
    shutil.copytree(ftw_for("qwen3_5_moe", "nvfp4"), ftw)
    env = _env(tmp_path)
    res = subprocess.run([*FT, "kernels", "build", "--ftw", str(ftw), "--arch", "90", "--groups", GROUPS,
                          "--max-prefill-length", "32"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "sm_90:" in res.stdout and "failed" not in res.stdout, res.stdout

    from ft.formats import FtwReader, kernel_trust
    from ft.formats.kernels import describe, unpack

    r = FtwReader(ftw)
    (entry,) = r.records.slots["kernels"]
    data = (ftw / entry.name).read_bytes()
    ks = unpack(data, entry.name)
    assert ks.arch == 90 and ks.triton == __import__("triton").__version__
    launched = {k.function.rsplit(".", 1)[1] for k in ks.kernels}
    assert {"_rms_norm_kernel", "_route_kernel", "_router_kernel", "_decode_kernel", "_conv_kernel",
            "_recurrent_kernel", "_prep_kernel", "_state_kernel", "_dense_gemv_kernel", "_nvfp4_gemv_kernel",
            "_fp8_rows_gemv_kernel", "_gather_kernel", "_silu_mul_kernel", "_sigmoid_gate_add_kernel"} <= launched
    for k in ks.kernels:  # a cubin (ELF) for sm_90 and Triton's metadata for it
        meta = json.loads(k.files[f"{k.name}.json"])
        assert k.files[f"{k.name}.cubin"][:4] == b"\x7fELF" and meta["hash"] == k.hash and meta["name"] == k.name
        assert meta["target"]["arch"] == 90
    assert kernel_trust.trusted(kernel_trust.digest(data), tmp_path / "home" / "trusted_kernels") is not None
    assert r.verify() == []
    (info,) = [k for k in describe(r)]
    assert info["kernels"] == len(ks.kernels) and info["arch"] == 90

    cache = tmp_path / "triton-cache"
    cache.mkdir()
    res = subprocess.run([sys.executable, "-c", REPLAY, str(ftw), str(cache), GROUPS, "32"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["decision"] == "installed" and out["installed"] == len(ks.kernels) and out["stale"] == 0, out
    assert out["compiled"] == 0 and out["hits"] >= len(ks.kernels) and out["errors"] == [], out
    assert "prebuilt for sm_90" in out["message"]

    # built again: the entry for this Triton build and arch is replaced (same bytes: kept as it is)
    res = subprocess.run([*FT, "kernels", "build", "--ftw", str(ftw), "--arch", "sm_90", "--groups", "embedding",
                          "--max-prefill-length", "4"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (entry2,) = FtwReader(ftw).records.slots["kernels"]
    assert entry2.name != entry.name and not (ftw / entry.name).exists() and FtwReader(ftw).verify() == []


def test_geometry_of_gpt_oss_names_its_expert_format_sinks_and_windows(ftw_for):
    """The launches of a gpt_oss FTW use its MXFP4 records with the clamped SwiGLU, sinks, and both windows."""
    from ft.compiler.kernels import launches
    from ft.formats import FtwReader

    r = FtwReader(ftw_for("gpt_oss", "mxfp4"))
    cfg = r.config
    g = launches.geometry(r)
    assert g.experts == ("mxfp4", "clamped_swiglu", cfg.swiglu_alpha, cfg.swiglu_limit)
    assert g.sinks and g.windows == (0, cfg.sliding_window)
    q = launches.geometry(FtwReader(ftw_for("qwen3_moe", "nvfp4")))
    assert q.experts[:2] == ("nvfp4", "silu") and not q.sinks and q.windows == (0,)
