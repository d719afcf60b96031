"""Build every Triton kernel of the GPU runtime for sm_<ARCH> on a machine without a GPU, at the real models' sizes.

    python tools/compile_sm90.py [--arch 90] [--models qwen3.6-35b-a3b,qwen3moe-35b-geom | all] [--only fused,moe]

The runtime's own launchers are called with CPU tensors of the real shapes while Triton's active driver is a stand-in
reporting a CUDA target and every `kernel[grid](...)` is a warmup (compile, no launch). So each kernel is built with
the constexprs, specialization (16-byte alignment, divisibility) and launch options a real call on the GPU uses. The
few constexprs that the launchers set for Triton's CPU interpreter (DOT_F32, RNE_BITS, BITS, INTERP, ASM, F32,
ROUND_BF16) and PDL (`ft.runtime.gpu.pdl`, off without a GPU) are forced to their CUDA values. Prints one line per
distinct compiled kernel: registers, stack (spill) bytes, shared memory, or the error; exits 1 if any kernel failed to
build. Needs `ft` importable (the venv, or PYTHONPATH on a site dir that maps the namespace as tools/gpu_run.sh does)
and Triton's CUDA backend (its ptxas and cuobjdump ship in the wheel).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: kernels must be JITFunctions

import argparse  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

CUDA_VALUES = {"DOT_F32": False, "RNE_BITS": False, "BITS": False, "INTERP": False, "PDL": True, "ASM": True,
               "F32": False, "ROUND_BF16": False}  # launch switches
SMS = 132  # H200: the SM count decode attention's split count is derived from
BF16, F32 = torch.bfloat16, torch.float32


class _TargetOnly:
    """Triton driver stand-in: a CUDA target, device 0, stream 0; nothing is ever loaded or launched."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


class Recorder:
    def __init__(self):
        self.rows: dict[tuple, dict] = {}
        self.case = ""

    def run(self, fn: JITFunction, grid, args, kwargs):
        kwargs = {k: (CUDA_VALUES[k] if k in CUDA_VALUES else v) for k, v in kwargs.items()}
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in opts})
        consts = {p.name: bound.arguments[p.name] for p in fn.params if p.is_constexpr and p.name in bound.arguments}
        sig = tuple(_arg_sig(v) for n, v in bound.arguments.items() if n not in consts)
        key = (fn.fn.__module__, fn.fn.__name__, tuple(consts.items()), tuple(sorted(opts.items())), sig)
        row = self.rows.get(key)
        if row is None:
            row = {"kernel": f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}", "case": self.case,
                   "consts": consts, **opts}
            try:
                k = JITFunction.run(fn, *args, grid=grid, warmup=True, **kwargs)
                row.update(_usage(k))
            except Exception as e:  # noqa: BLE001 - report every kernel
                msg = str(e).strip().splitlines()
                row["error"] = f"{type(e).__name__}: {' | '.join(msg[-3:])}"[:500]
            self.rows[key] = row
            print(_fmt(row), flush=True)
        return None


def _arg_sig(a):
    if isinstance(a, torch.Tensor):
        return (str(a.dtype), a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        return type(a).__name__
    return ("int", a == 1, a % 16 == 0, a >= 2**31)


def _usage(k) -> dict:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    use = {key: int(v) for key, v in re.findall(r"(REG|STACK):(\d+)", res)}
    return {"regs": use.get("REG"), "stack": use.get("STACK"), "shared": k.metadata.shared}


def _fmt(row: dict) -> str:
    consts = ",".join(f"{k}={v}" for k, v in row["consts"].items())
    opts = f"w={row.get('num_warps', '-')} s={row.get('num_stages', '-')}"
    res = (f"ERROR {row['error']}" if "error" in row else
           f"regs={row['regs']} stack={row['stack']} shared={row['shared']}")
    return f"{row['kernel']:34s} {row['case']:28s} {opts:9s} {res}   [{consts}]"


def install(arch: int) -> Recorder:
    rec = Recorder()
    driver.set_active(_TargetOnly(arch))
    JITFunction.__getitem__ = lambda self, grid: (lambda *a, **kw: rec.run(self, grid, a, kw))
    return rec


# ---- the launches, per model geometry -------------------------------------------------------------------------------
def geometries(names):
    from ft.compiler.synth.presets import FULL_SIZE, PRESETS

    for name in (FULL_SIZE if names == ["all"] else names):
        (arch, c), = PRESETS[name].configs.items()
        c = {**c, **c.get("text_config", {})}
        hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        yield name, dict(
            H=c["hidden_size"], I=c.get("moe_intermediate_size", c.get("intermediate_size")),
            E=c.get("num_experts", c.get("num_local_experts")), k=c["num_experts_per_tok"],
            nq=c["num_attention_heads"], nkv=c["num_key_value_heads"], hd=hd,
            rd=int(hd * c.get("partial_rotary_factor", 1.0)), gated=arch in ("qwen3_next", "qwen3_5_moe"),
            qk_norm=arch in ("qwen3_moe", "qwen3_next", "qwen3_5_moe"),
            shared_I=c.get("shared_expert_intermediate_size") or c.get("intermediate_size"),
            gdn=(c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                 c["linear_value_head_dim"], c["linear_conv_kernel_dim"]) if "linear_num_key_heads" in c else None)


def _addr(n: int) -> torch.Tensor:  # int64 "device addresses" (16-byte aligned); never dereferenced here
    return (torch.arange(n, dtype=torch.int64) + 1) << 20


def fused(g):
    from ft.runtime.gpu import fused_ops as f

    H, E = g["H"], g["E"]
    for T in (1, 8, 512, 4096):
        x = torch.zeros(T, H, dtype=BF16)
        f.rms_norm(x, torch.ones(H), 1e-6)
        f.add_rms_norm(x, x.clone(), torch.ones(H), 1e-6)
        f.route_topk(torch.zeros(T, E, dtype=BF16), g["k"], True)
        f.silu_mul(torch.zeros(T, 2 * g["shared_I"], dtype=BF16))
        f.sigmoid_gate_add(x, torch.zeros(T, 1, dtype=BF16), x.clone())
        qkv = torch.zeros(T, (g["nq"] + 2 * g["nkv"]) * g["hd"], dtype=BF16)
        f.rms_norm(qkv[:, : g["nq"] * g["hd"]].view(T, g["nq"], g["hd"]), torch.ones(g["hd"]), 1e-6)


def router(g):
    from ft.runtime.gpu.router import MAX_TOKENS, router_topk

    H, E = g["H"], g["E"]
    for T in (1, 2, 8, MAX_TOKENS):
        x = torch.zeros(T, H, dtype=BF16)
        for extra in (None, torch.zeros(1, H, dtype=BF16)):
            router_topk(x, torch.zeros(E, H, dtype=BF16), g["k"], True, extra)


def attention(g):
    from ft.runtime.gpu import decode_attention as da

    nq, nkv, hd = g["nq"], g["nkv"], g["hd"]
    for B in (1, 8, 64):
        rows = (nq + 2 * nkv) * hd + (nq * hd if g["gated"] else 0)
        qkv = torch.zeros(B, rows, dtype=BF16)
        norm = torch.ones(hd) if g["qk_norm"] else None
        cos = torch.zeros(B, g["rd"]) if g["rd"] else None
        tables, pos = _addr(2 * B).view(2, B), torch.zeros(B, dtype=torch.int64)
        want = triton.cdiv(da.CONFIG["programs_per_sm"] * SMS, B * nkv)
        S = max(da.CONFIG["min_splits"], min(da.CONFIG["max_splits"], triton.next_power_of_2(want)))
        da.decode_attention(qkv, norm, norm, 1e-6, cos, cos, tables, pos, nq=nq, nkv=nkv, hd=hd, scale=hd ** -0.5,
                            gated=g["gated"], splits=S)


def deltanet(g):
    if g["gdn"] is None:
        return
    from ft.runtime.gpu.deltanet_decode import gdn_decode
    from ft.runtime.gpu.deltanet_prefill import gdn_chunk_prefill

    hk, hv, dk, dv, K = g["gdn"]
    C = 2 * hk * dk + hv * dv
    for B in (1, 8, 64):
        ba = torch.zeros(B, 2 * hv, dtype=BF16)
        gdn_decode(torch.zeros(B, C, dtype=BF16), torch.zeros(B, hv * dv, dtype=BF16), ba[:, :hv], ba[:, hv:],
                   torch.zeros(C, K, dtype=BF16), torch.zeros(hv), torch.zeros(hv), torch.ones(dv), 1e-6,
                   _addr(2 * B).view(2, B), hk=hk, hv=hv, dk=dk, dv=dv)
    for T in (2, 512, 4096):
        qk = torch.zeros(T, hk, dk)
        gdn_chunk_prefill(qk, qk.clone(), torch.zeros(T, hv, dv), torch.zeros(T, hv), torch.zeros(T, hv),
                          torch.zeros(hv, dk, dv))


def _pool(H, I, slots):
    from ft.runtime.gpu.record_layout import RecordLayout

    layout = RecordLayout.packed(H, I)
    return layout, torch.zeros(slots, layout.stride, dtype=torch.uint8)


def moe(g):
    from ft.runtime.gpu.gather import gather_missing
    from ft.runtime.gpu.nvfp4_decode import moe_nvfp4_device
    from ft.runtime.gpu.nvfp4_decode_mma import moe_nvfp4_mma
    from ft.runtime.gpu.host_plan import moe_nvfp4
    from ft.runtime.gpu.nvfp4_triton import TILE_CONFIGS
    from ft.runtime.gpu.prefill_plan import moe_nvfp4_prefill

    H, I, E, k = g["H"], g["I"], g["E"], g["k"]
    layout, pool = _pool(H, I, E + 64)
    row = torch.arange(E, dtype=torch.int32)
    for T in (1, 4):
        ids, w = torch.arange(T * k).view(T, k) % E, torch.ones(T, k)
        x = torch.zeros(T, H, dtype=BF16)
        for combine in ("tokens", "pairs"):
            moe_nvfp4_device(pool, layout, x, ids, row, w, combine=combine)
        moe_nvfp4_device(pool, layout, x, ids, row, w, host_base=1 << 40, host_stride=layout.stride)
        if T > 1:  # the tensor-core decode kernels (batch 3 and up), resident and mapped
            moe_nvfp4_mma(pool, layout, x, ids, row, w, out_dtype=BF16)
            moe_nvfp4_mma(pool, layout, x, ids, row, w, host_base=1 << 40, host_stride=layout.stride)
        if T * k <= 64:
            gather_missing(pool, layout, ids, row[None].clone(), 0, 1 << 40, layout.stride, E)
    for T in (512, 4096, 16384):  # the resident prefill (device plan), the tile config pick_blocks picks for T
        ids = (torch.arange(T * k) % E).view(T, k)
        moe_nvfp4_prefill(pool, layout, torch.zeros(T, H, dtype=BF16), ids, row, torch.ones(T, k))
    T = 512
    slots = (torch.arange(T * k) % E).numpy()
    for blocks in TILE_CONFIGS.values():  # every tile config, host-planned (the same kernels)
        moe_nvfp4(pool, layout, torch.zeros(T, H, dtype=BF16), slots, torch.ones(T, k), blocks=blocks)


def dense(g):
    from ft.runtime.gpu.dense_quant import quantized_gemv

    H = g["H"]
    for K, N in ((H, g["nq"] * g["hd"]), (g["nq"] * g["hd"], H), (g["shared_I"], H)):
        buf = torch.zeros(N * K // 2 + N * K // 16, dtype=torch.uint8)
        w, s = buf[: N * K // 2].view(N, K // 2), buf[N * K // 2:].view(torch.float8_e4m3fn).view(N, K // 16)
        for s2 in (torch.ones(1), torch.ones(N)):
            quantized_gemv("nvfp4", torch.zeros(1, K, dtype=BF16), w, s, s2)
        quantized_gemv("fp8_row", torch.zeros(1, K, dtype=BF16), torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                       torch.ones(N), None)


GROUPS = {"fused": fused, "router": router, "attention": attention, "deltanet": deltanet, "moe": moe, "dense": dense}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--models", default="qwen3.6-35b-a3b,qwen3moe-35b-geom", help="presets of ft synth, or all")
    ap.add_argument("--only", default=",".join(GROUPS), help="kernel groups: " + ", ".join(GROUPS))
    args = ap.parse_args(argv)
    rec = install(args.arch)
    print(f"triton {triton.__version__}, torch {torch.__version__}, target sm_{args.arch}")
    for name, g in geometries(args.models.split(",")):
        for group in args.only.split(","):
            rec.case = f"{name}/{group}"
            try:
                GROUPS[group](g)
            except Exception as e:  # noqa: BLE001 - a launcher that fails on the host: report, go on
                rec.rows[(name, group)] = {"kernel": f"<{group} launcher>", "case": rec.case, "consts": {},
                                           "error": f"{type(e).__name__}: {e}"[:300]}
                print(_fmt(rec.rows[(name, group)]), flush=True)
    bad = [r for r in rec.rows.values() if "error" in r]
    spills = [r for r in rec.rows.values() if r.get("stack")]
    print(f"{len(rec.rows)} kernels built, {len(bad)} failed, {len(spills)} with stack (spill) bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
