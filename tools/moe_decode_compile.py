"""`tools/bench_moe_decode.py --compile-only`: the decode kernels' tile configs built for a CUDA arch with no GPU."""

from __future__ import annotations


def fmt_row(r: dict) -> str:
    """A result row as `key=value` pairs (its tile `blocks` left out)."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "blocks")


def sass_stats(fn, values: dict, consts: dict, warps: int, arch: int) -> dict:
    """Build Triton kernel `fn` for sm_<arch> with no GPU (Triton's CUDA backend, ptxas, nvdisasm) -> {regs, stack
    (spill bytes), sts (shared-memory stores), instructions (SASS, static)}. `values`: each runtime argument's value
    (an int, or a pointer type such as "*bf16"); `consts`: the constexprs."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        v = consts.get(arg, values.get(arg))
        sig[arg] = "constexpr" if arg in consts else (v if isinstance(v, str) else "i32")
        if isinstance(v, str) or (arg not in consts and v % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    use = {key: int(v) for key, v in re.findall(r"(REG|STACK):(\d+)", res)}
    ops = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return {"regs": use.get("REG"), "stack": use.get("STACK"), "sts": sum(o.startswith("STS") for o in ops),
            "instructions": len(ops)}


def compile_configs(gu: dict, dn: dict, *, hidden=2048, inter=512, top_k=8, arch=90, scheme="nvfp4",
                    early=False, log=print) -> list[dict]:
    """Build each config's kernel for sm_<arch> with no GPU (`sass_stats`): regs, stack (spill) bytes, STS count and
    SASS instructions per weight. A CPU check of the kernels before a GPU run. scheme "mxfp4": gpt-oss's records
    (biases, the clamped SwiGLU)."""
    import triton

    from ft.runtime.gpu.kernels import nvfp4_decode as nd
    from ft.runtime.gpu.record_layout import RecordLayout

    lay = RecordLayout.packed(hidden, inter, scheme, act="clamped_swiglu" if scheme == "mxfp4" else "silu")
    fmt = {kn: lay.kernel_args(kn) for kn in ("gate_up", "down")}  # offsets are arguments, the rest constexprs
    common = dict(pool="*u8", slot_stride=lay.stride, host_base=0, host_stride=0, topk_ids="*i32", slot_row="*i32",
                  H=hidden, I=inter)
    specs = {"gate_up": (nd._gate_up_kernel, dict(common, x="*bf16", act="*bf16", copied="*i32", topk=top_k,
                                                  OFF_GU=lay.off_gate_up, OFF_GUS=lay.off_gate_up_scale)),
             "down": (nd._down_kernel, dict(common, act="*bf16", out="*fp32", pair_weight="*fp32", G=top_k,
                                            OFF_D=lay.off_down, OFF_DS=lay.off_down_scale))}
    rows = []
    for kname, configs in (("gate_up", gu), ("down", dn)):
        fn, vals = specs[kname]
        vals = {**vals, **{k: v for k, v in fmt[kname].items() if k.startswith("OFF_")}}
        for name, cfg in configs.items():
            b = nd.decode_blocks(cfg)
            if kname == "gate_up":
                consts = dict(KB=hidden // 16, BN=b["BLOCK_N_GU"], BKB=nd._words(b["BLOCK_K_GU"], hidden),
                              EARLY=early)
                warps, weights = b["WARPS_GU"], 2 * b["BLOCK_N_GU"] * hidden
            else:
                consts = dict(KB=inter // 16, GP=triton.next_power_of_2(top_k), BN=b["BLOCK_N_D"],
                              BKB=nd._words(b["BLOCK_K_D"], inter))
                warps, weights = b["WARPS_D"], triton.next_power_of_2(top_k) * b["BLOCK_N_D"] * inter
            consts.update(INTERP=False, MAPPED=False, PDL=True,
                          **{k: v for k, v in fmt[kname].items() if not k.startswith("OFF_")})
            row = {"kernel": kname, "config": name, "arch": arch}
            try:
                st = sass_stats(fn, vals, consts, warps, arch)
                row.update(regs=st["regs"], stack=st["stack"], sts=st["sts"],
                           instr_per_weight=round(st["instructions"] * warps * 32 / weights, 2))
            except Exception as e:  # noqa: BLE001 - report every config
                row["error"] = f"{type(e).__name__}: {e}"[-400:]
            rows.append(row)
            log(fmt_row(row))
    return rows
