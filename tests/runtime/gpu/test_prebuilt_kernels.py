"""Prebuilt kernels on a GPU: `ft kernels build` for this GPU's arch, then a fresh process with an empty Triton cache
serves a prefill and decode steps, resident and offloaded (mapped: the CPU lane and the gather kernels), and
compiles no kernel; the same from a signed bundle unpacked on a machine that trusts only the signer's key. Any kernel
it did compile is named in the failure (its constexprs too): a launch the build (`ft.compiler.kernels.launches`) does
not cover yet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SERVE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from ft.runtime.engine import Engine, EngineSettings, SamplingParams, generate
from ft.runtime.gpu import engine_setup
from ft.runtime.gpu.sizing import LATE_OUTSIDE
ftw = sys.argv[1]
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
prompt = [(7 * i + 3) % 500 for i in range(40)]  # one prefill chunk of 40 tokens, then decode steps
# the default max running requests (4): graphs of 1, 2 and 4 rows captured at start (the tensor-core MoE kernels
# from 3 rows: their first call's check in fp32, then the compute dtype)
kw = dict(device="cuda", kv_reserve_tokens=256)
eng = Engine(ftw, EngineSettings(memory_ratio=0.5, **kw))
plan, ex = eng._experts.vram_plan, eng._experts
generate(eng, prompt, params)
first = eng.stats()["kernels"]
eng.close()
engine_setup.device_in_use = lambda dev: 0  # the budget below is a few slots: finer than the context's measure
budget = LATE_OUTSIDE + plan.dense + plan.kv + plan.prefill_buffers + plan.reserve + 5 * ex.layout.stride + 4096
eng = Engine(ftw, EngineSettings(vram_budget=budget, **kw))
eng._experts.wait_pinned()
generate(eng, prompt, params)
mode = eng._experts.opts.mode
print(json.dumps({"first": first, "second": eng.stats()["kernels"], "mode": mode}))
eng.close()
"""


def _ft(args: list[str], env: dict) -> str:
    res = subprocess.run([sys.executable, "-c", "from ft.cli.main import main; main()", *args], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _serve(ftw, env: dict) -> dict:
    """SERVE in a fresh process with an empty Triton cache; asserts it compiled nothing, resident then offloaded."""
    env = {**env, "TRITON_CACHE_DIR": str(ftw.parent / f"empty-cache-{ftw.name}")}
    res = subprocess.run([sys.executable, "-c", SERVE, str(ftw)], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    first, second = out["first"], out["second"]
    assert first["prebuilt"] == "installed" and first["installed"] > 0 and first["stale"] == 0, first
    assert out["mode"] == "mapped", out
    assert first["compiled_since_start"] == 0, first["compiled"]  # resident: start, prefill, decode
    assert second["compiled_since_start"] == 0, second["compiled"]  # the same process, offloaded: nothing new
    return out


@pytest.fixture()
def built(ftw_for, tmp_path):
    """(an FTW with kernels built for this GPU by `ft kernels build`, the builder's environment)."""
    ftw = tmp_path / "m"
    shutil.copytree(ftw_for("qwen3_5_moe", "nvfp4", synth_dtype="bf16"), ftw)
    major, minor = torch.cuda.get_device_capability()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FT_HOME"] = str(tmp_path / "home")
    _ft(["kernels", "build", "--ftw", str(ftw), "--arch", str(10 * major + minor), "--max-prefill-length", "64"], env)
    return ftw, env


def test_prebuilt_kernels_serve_with_zero_compiles(built):
    _serve(*built)


def test_a_trusted_bundle_serves_with_zero_compiles_on_another_machine(built, tmp_path):
    """The builder signs a bundle of the FTW (kernels inside); a machine that has never built or trusted those kernels
    (its own FT_HOME) trusts the builder's key, unpacks, and serves with zero compiles."""
    ftw, env = built
    _ft(["trust", "keygen", str(tmp_path / "key")], env)
    _ft(["bundle", "pack", str(ftw), str(tmp_path / "m.ftb"), "--sign", str(tmp_path / "key")], env)
    other = {**env, "FT_HOME": str(tmp_path / "other-home")}
    _ft(["trust", "add", (tmp_path / "key.pub").read_text().strip()], other)
    out = _ft(["bundle", "unpack", str(tmp_path / "m.ftb"), str(tmp_path / "unpacked")], other)
    assert "kernels entries are trusted here" in out, out
    _serve(tmp_path / "unpacked", other)
