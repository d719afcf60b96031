"""Campaign: coverage-guided fuzz of the FTW index parser; the target is no exception but FtwError and no hang.

    python tools/campaign_fuzz_ftw.py --out DIR [--runs 1000000] [--seed 1] [--timeout-s 5]

Needs atheris (`pip install atheris`; libFuzzer for Python, not a project dependency). The seeds are the index files
(`model.ftw`) of tiny FTWs compiled here: qwen3_moe and qwen3_5_moe, BF16 and NVFP4, so every manifest section the
compiler writes is in the corpus. An input's first byte picks what the rest is:
  * even: a whole index file, through `parse_index` (rules V1..V8: magic, version, header fields, sizes, checksum);
  * odd: a manifest body, wrapped in a valid header with its checksum so that mutations get past it into the JSON
    decoding and the manifest / model-config rules (`parse_index` then `parse_manifest`).
Anything raised that is not an FtwError is a crash (libFuzzer stops and keeps the input), and an input running past
`--timeout-s` a hang. The fuzzing runs in a child process (libFuzzer exits when done); this process writes
DIR/campaign_fuzz_ftw.json: command, runs, seconds, crashes, corpus size, coverage, and the tail of libFuzzer's log.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]
SEEDS = [("qwen3_moe", "none"), ("qwen3_moe", "nvfp4"), ("qwen3_5_moe", "none"), ("qwen3_5_moe", "nvfp4")]


def make_seeds(corpus: Path, work: Path) -> int:
    """Compile the tiny FTWs and write each index file twice into `corpus`: whole (mode 0) and as its manifest
    body (mode 1)."""
    from ft.formats.layout import HEADER_SIZE

    n = 0
    for arch, quant in SEEDS:
        hf, ftw = work / f"{arch}-{quant}-hf", work / f"{arch}-{quant}.ftw"
        subprocess.run([*FT, "synth", "--arch", arch, "--preset", "tiny", "--out", str(hf), "--quant", quant],
                       check=True, capture_output=True)
        subprocess.run([*FT, "checkpoint", "--model", str(hf), "--out", str(ftw)], check=True, capture_output=True)
        raw = (ftw / "model.ftw").read_bytes()
        (corpus / f"{arch}-{quant}-index").write_bytes(b"\x00" + raw)
        (corpus / f"{arch}-{quant}-manifest").write_bytes(b"\x01" + raw[HEADER_SIZE:])
        n += 2
    return n


def child() -> None:
    import atheris

    with atheris.instrument_imports(include=["ft.formats"]):
        from ft.formats.errors import FtwError
        from ft.formats.layout import Header
        from ft.formats.manifest import parse_manifest
        from ft.formats.reader import parse_index

    def one_input(data: bytes) -> None:
        if not data:
            return
        body = data[1:]
        raw = body if data[0] % 2 == 0 else Header.for_manifest(body).pack() + body
        try:
            parse_manifest(parse_index(raw, "fuzz"), "fuzz")
        except FtwError:
            pass

    atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
    atheris.Fuzz()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-s", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=1 << 16)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work, corpus = Path(tmp), args.out / "corpus"
        corpus.mkdir(exist_ok=True)
        seeds = make_seeds(corpus, work)
        crashes = args.out / "crashes"
        crashes.mkdir(exist_ok=True)
        cmd = [sys.executable, __file__, "--child", f"-runs={args.runs}", f"-seed={args.seed}",
               f"-timeout={args.timeout_s}", f"-max_len={args.max_len}", "-print_final_stats=1",
               f"-artifact_prefix={crashes}/", str(corpus)]
        t = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t
    log = res.stdout + res.stderr
    (args.out / "libfuzzer.log").write_text(log)
    done = re.search(r"Done (\d+) runs in (\d+) second", log)
    cov = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", log)
    found = sorted(p.name for p in crashes.iterdir())
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime()),
        "seeds": seeds, "runs": int(done.group(1)) if done else None, "seconds": seconds,
        "returncode": res.returncode, "crashes_or_hangs": found,
        "coverage": {"cov": int(cov[-1][0]), "features": int(cov[-1][1]), "corpus": int(cov[-1][2])} if cov else None,
        "final_stats": [line for line in log.splitlines() if line.startswith("stat::")],
        "tail": log.strip().splitlines()[-15:],
    }
    (args.out / "campaign_fuzz_ftw.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("runs", "seconds", "returncode", "crashes_or_hangs", "coverage")}))
    sys.exit(0 if res.returncode == 0 and not found else 1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
