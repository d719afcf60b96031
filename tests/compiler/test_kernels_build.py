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


LAUNCHERS = """
import json, sys
from triton import knobs
from ft.formats import FtwReader
from ft.runtime.gpu.prebuilt import use_prebuilt
from ft.compiler.kernels import launches
from ft.compiler.kernels.launchers import LauncherBuilder
from ft.compiler.kernels.stand_in import cuda_target
ftw, cache, groups = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
knobs.cache.dir = cache
status = use_prebuilt(FtwReader(ftw), 90)
lb = LauncherBuilder.for_this_triton(cache_dir=cache)  # Triton's own key and lookup; counts what it must compile
with cuda_target(90, cache_dir=cache) as rec:
    for name in groups:
        launches.GROUPS[name](launches.geometry(FtwReader(ftw)), launches.prefill_lengths(8))
    kernels = list(rec.built.values())
lb.add_utils()
for b in kernels:
    lb.add(b.kernel)
print(json.dumps({"launchers": status.launchers, "found": len(lb.launchers), "compiled": lb.builds,
                  "errors": lb.errors, "kernels": len(kernels), "message": status.message}))
"""


def test_launchers_are_prebuilt_and_found_under_the_key_triton_computes_at_start(ftw_for, tmp_path):
    """Triton 3.6: the host launcher of every kernel is in the container and, installed, is what Triton's lookup
    finds for that kernel in a fresh process (nothing compiled); where this Triton or machine has nothing to
    prebuild, the build says so and stores none."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from ft.compiler.kernels.launchers import LauncherBuilder

    ftw = tmp_path / "m"
    shutil.copytree(ftw_for("qwen3_moe", "nvfp4"), ftw)
    env = _env(tmp_path)
    res = subprocess.run([*FT, "kernels", "build", "--ftw", str(ftw), "--arch", "90", "--groups", "fused,embedding",
                          "--max-prefill-length", "8"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    why = LauncherBuilder.why_not()
    if why is not None:
        assert " 0 launchers" in res.stdout and "host launchers not prebuilt" in res.stderr, res.stdout + res.stderr
        pytest.skip(f"no prebuilt launchers here: {why}")
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    res = subprocess.run([sys.executable, "-c", LAUNCHERS, str(ftw), str(cache), "fused,embedding"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["kernels"] > 0, out
    assert out["compiled"] == 0 and out["launchers"] == out["found"] >= 2, out  # cuda_utils and >= 1 launcher


KEYS_BUILD = """
import json, torch
from ft.compiler.kernels.stand_in import cuda_target
from ft.runtime.gpu.kernels.nvfp4_decode_mma import moe_nvfp4_mma
from ft.runtime.gpu.record_layout import RecordLayout
from ft.runtime.gpu.triton_cache import KERNEL_MODULES, kernel_function, source_key
layout = RecordLayout.packed(256, 128)
with cuda_target(90):  # the build: the gate_up kernel is launched (and hashed) before the down kernel
    moe_nvfp4_mma(torch.zeros(9, layout.stride, dtype=torch.uint8), layout, torch.zeros(2, 256, dtype=torch.bfloat16),
                  torch.tensor([[0, 1], [1, 2]]), torch.arange(8, dtype=torch.int32), torch.ones(2, 2),
                  out_dtype=torch.bfloat16)
names = [f"ft.runtime.gpu.kernels.nvfp4_decode_mma.{k}" for k in ("_gate_up_mma_kernel", "_down_mma_kernel")]
print(json.dumps({n: source_key(kernel_function(n)) for n in names}))
"""

KEYS_START = """
import json
from ft.runtime.gpu.triton_cache import kernel_function, settle_source_keys, source_key
names = [f"ft.runtime.gpu.kernels.nvfp4_decode_mma.{k}" for k in ("_gate_up_mma_kernel", "_down_mma_kernel")]
kernel_function(names[1]).cache_key  # hashed first, as installing kernels in name order did
settle_source_keys()  # what `install` does before it compares source keys
print(json.dumps({n: source_key(kernel_function(n)) for n in names}))
"""


def test_the_source_keys_a_build_records_are_the_ones_the_runtime_computes(tmp_path):
    """Triton 3.6 folded a callee's global constants into a caller's key only if the callee was hashed first, so
    the build (which launches gate_up before down) and the runtime (which hashed down first) disagreed on the down
    kernel's key and compiled it again; both now key every kernel callees first."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = _env(tmp_path)
    got = []
    for script in (KEYS_BUILD, KEYS_START):
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        got.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert got[0] == got[1] and len(set(got[0].values())) == 2


RUNTIME_CALLS = """
import json, sys, torch
from triton import knobs
from ft.formats import FtwReader
from ft.runtime.gpu.cpu import lane as cpu_lane
from ft.runtime.gpu.cpu import lane_rates
from ft.runtime.gpu.kernels import decode_attention as da
from ft.runtime.gpu.kernels.gather import gather_missing
from ft.runtime.gpu.graphs import bucket_sizes
from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device
from ft.runtime.gpu.kernels.nvfp4_decode_mma import MMA_MIN_TOKENS, decode_kernel
from ft.runtime.gpu.prebuilt import use_prebuilt
from ft.runtime.gpu.record_layout import RecordLayout
from ft.runtime.layers.batch import decode_inputs, decode_inputs_size
from ft.runtime.layers.rope import Rotary
from ft.compiler.kernels.stand_in import cuda_target
ftw, cache, max_batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
knobs.cache.dir = cache
r = FtwReader(ftw)
status = use_prebuilt(r, 90)
c = r.config
L, E, k, H, I = c.num_layers, c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
layout = RecordLayout.from_bank(r.bank("layers.0.mlp.experts"), H, I)
dt = r.tensor("embed_tokens.weight").dtype  # the compute dtype
rotary, cuda = Rotary.for_config(c), torch.device("cuda", 0)
pool = torch.zeros(E + 80, layout.stride, dtype=torch.uint8)
with cuda_target(90, cache_dir=cache):
    # decode steps of 1..max_batch sequences: eager (CausalLM._plan) and the CUDA graphs of every bucket, in the
    # buffers they use, S as num_splits picks it on GPUs of 132 (H100 SXM, H200) and 114 (H100 PCIe) SMs
    steps = [(B, False) for B in range(1, max_batch + 1)] + [(G, True) for G in bucket_sizes(max_batch)]
    for B, ids in steps:
        _, pos, tables = decode_inputs(torch.zeros(decode_inputs_size(B, L, ids=ids), dtype=torch.int64), B, L,
                                       ids=ids)
        cos, sin = rotary.cos_sin(torch.arange(B), dt)
        qkv = torch.zeros(B, (c.num_heads * (2 if c.attn_output_gate else 1) + 2 * c.num_kv_heads) * c.head_dim,
                          dtype=dt)
        norm = torch.ones(c.head_dim) if c.attn_qk_norm else None
        for sms in (132, 114):
            da._SMS[0] = sms
            for layer in (0, L - 1):
                da.decode_attention(qkv, norm, norm, 1e-6, cos, sin, tables[layer], pos, nq=c.num_heads,
                                    nkv=c.num_kv_heads, hd=c.head_dim, scale=1.0, gated=c.attn_output_gate,
                                    splits=da.num_splits(B, c.num_kv_heads, cuda))
    table = torch.full((L, E), -1, dtype=torch.int32)
    for n in lane_rates.COPY_RATE_MISSES:  # the CPU lane's calibration at start
        gather_missing(pool, layout, torch.arange(n, dtype=torch.int32).view(1, n), table, 0, 1 << 40,
                       layout.stride, E)
    entry = torch.full((3, cpu_lane.MAX_DEVICE_PAIRS), -1, dtype=torch.int32)
    P = 2 * k  # mode mapped: the resident kernel over the pairs the gather planned (MappedPath._kernel)
    moe_nvfp4_device(pool, layout, torch.zeros(2, H, dtype=dt),
                     torch.arange(P, dtype=torch.int32).view(2, k), entry[1, :P], torch.ones(2, k))
    row = torch.arange(E, dtype=torch.int32)
    for T in range(MMA_MIN_TOKENS, max_batch + 1):  # the tensor-core decode kernels, as device_path calls them:
        ids, w, x = torch.arange(T * k).view(T, k) % E, torch.ones(T, k), torch.zeros(T, H, dtype=dt)
        decode_kernel(T)(pool, layout, x, ids, row, w)  # the first call's check (fp32 out)
        decode_kernel(T)(pool, layout, x, ids, row, w, out_dtype=dt)  # then the compute dtype
        decode_kernel(T)(pool, layout, x, ids, row, w, host_base=1 << 40, host_stride=layout.stride)  # mapped
print(json.dumps({"decision": status.decision, "compiled": status.counter.compiled, "names": status.counter.names}))
"""


def test_the_build_covers_what_the_runtime_passes_not_only_what_it_replays(ftw_for, tmp_path):
    """Launch classes that compiled at start on a GPU although the build ran: decode positions and tables inside one
    buffer (8 bytes off alignment for odd batches; strides equal to 1 for one sequence), cos / sin in the compute
    dtype, the CPU lane's calibration gathers (int32 ids, a fresh entry), mode mapped's resident kernel over int32
    pair ids, the tensor-core decode kernels' fp32 output. Each is made here the way the runtime makes it, for the
    default --max-running-requests, on a bf16 model (an fp32 one hides the compute dtype's classes)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from ft.runtime.settings import EngineSettings

    ftw = tmp_path / "m"
    shutil.copytree(ftw_for("qwen3_moe", "nvfp4", synth_dtype="bf16"), ftw)
    env = _env(tmp_path)
    res = subprocess.run([*FT, "kernels", "build", "--ftw", str(ftw), "--arch", "90", "--groups", "attention,moe",
                          "--max-prefill-length", "4"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    res = subprocess.run([sys.executable, "-c", RUNTIME_CALLS, str(ftw), str(cache),
                          str(EngineSettings().max_running_requests)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["decision"] == "installed" and out["compiled"] == 0, json.dumps(out, indent=1)  # every name


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
