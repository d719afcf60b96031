"""Mode mapped's miss copy (`gather._copy_kernel`) on the GPU: time and GB/s against the number of records copied per
call and the program shape, page-locked host memory -> VRAM staging rows, read by SMs over PCIe.

    python tools/bench_gather.py --out DIR [--records 1,2,4,8] [--hidden 2048 --inter 512]

A decode call of P = 8 pairs copies its misses (1..8 records, the rest hits or the CPU's); every row launches the
kernel as `gather_missing` does, grid (P, record words / CHUNK), with a different CHUNK (8-byte words per program),
BLOCK (words per load; BLOCK = CHUNK issues all of a program's loads before its stores) and warps. Each row is
checked byte for byte. Writes DIR/bench_gather.json ({"meta", "rows"}) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = [(4096, 512, 4), (4096, 4096, 4), (4096, 4096, 8), (2048, 2048, 4), (1024, 1024, 2), (8192, 8192, 8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--records", default="1,2,4,8")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    import triton
    import triton.testing

    from ft.runtime.gpu.kernels.gather import _copy_kernel
    from ft.runtime.gpu.pinning import device_pointer
    from ft.runtime.gpu.record_layout import RecordLayout

    layout = RecordLayout.packed(args.hidden, args.inter)
    E, P = 64, 8
    words = layout.stride // 8
    bank = torch.randint(0, 255, (E, layout.stride), dtype=torch.uint8).pin_memory()
    base = device_pointer(bank.data_ptr())
    pool = torch.zeros(P, layout.stride, dtype=torch.uint8, device="cuda")
    ids = torch.arange(0, 8 * P, 8, dtype=torch.int64, device="cuda")[:P]  # records 0, 8, 16, ...
    rows = []
    for n in [int(v) for v in args.records.split(",")]:
        copy = torch.tensor([1] * n + [0] * (P - n), dtype=torch.int32, device="cuda")
        slot = torch.arange(P, dtype=torch.int32, device="cuda")
        for chunk, block, warps in SHAPES:
            def run():
                _copy_kernel[(P, triton.cdiv(words, chunk))](pool, layout.stride, base, layout.stride, ids, slot, copy,
                                                             words, CHUNK=chunk, BLOCK=block, num_warps=warps,
                                                             PDL=False)
            pool.zero_()
            run()
            torch.cuda.synchronize()
            ok = all(torch.equal(pool[p].cpu(), bank[8 * p]) for p in range(n))
            ms = triton.testing.do_bench(run, warmup=20, rep=100, return_mode="median")
            moved = n * layout.stride
            rows.append({"records": n, "chunk": chunk, "block": block, "warps": warps, "us": ms * 1e3,
                         "gbs": moved / ms / 1e6, "exact": ok})
            r = rows[-1]
            print(f"records {n}  CHUNK {chunk:5d} BLOCK {block:5d} warps {warps}  {r['us']:7.1f} us  "
                  f"{r['gbs']:5.1f} GB/s  exact {ok}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
            "record_bytes": layout.stride, "command": " ".join(sys.argv)}
    (args.out / "bench_gather.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
