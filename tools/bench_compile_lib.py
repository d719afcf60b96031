"""Disk probes and the markdown report of tools/bench_compile.py.

Each direction is probed two ways, because on some disks the page-cache path is several times slower than direct
I/O (measured on the benchmark VM: buffered write + fsync 0.2-1.2 GB/s, O_DIRECT write 1.2-1.7 GB/s): buffered
(read after dropping the cache; write of 64 MiB blocks then fsync) and O_DIRECT (8 MiB reads; 64 MiB writes, then
fsync). The floor uses the faster of the two for each direction: the disk's speed, whatever path the compile takes.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

G = 1e9
METHODS = ("buffered", "direct")


def evict(paths: list[Path]) -> None:
    """Drop the given files' clean pages from the page cache (any reader may; sync first: dirty pages stay)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_cache(paths: list[Path]) -> str:
    """Empty the page cache so reads hit the disk: system-wide as root, else the given files' clean pages."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        evict(paths)
        return "fadvise"


def disk_counters(path: Path) -> tuple[int, int, int] | None:
    """(bytes read, bytes written, milliseconds busy) so far of the block device holding `path` (/proc/diskstats), or
    None where it is not one (tmpfs, overlay) or there is no /proc/diskstats."""
    dev = os.stat(path).st_dev
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if (int(v[0]), int(v[1])) == (os.major(dev), os.minor(dev)):
                    return int(v[5]) * 512, int(v[9]) * 512, int(v[12])  # sectors of 512 bytes, whatever the disk's
    except (OSError, ValueError, IndexError):
        pass
    return None


def disk_timeline(path: Path, running, step: float = 0.1) -> list[list[float]]:
    """While `running()` is true: every `step` seconds [seconds since the start, GB/s read, GB/s written, share of the
    step the device was busy] of the disk holding `path` ([] where `disk_counters` has none)."""
    t0 = last = time.perf_counter()
    prev, out = disk_counters(path), []
    while running():
        time.sleep(step)
        now, t = disk_counters(path), time.perf_counter()
        if prev is not None and now is not None:
            dt = t - last
            out.append([round(t - t0, 2), round((now[0] - prev[0]) / G / dt, 3),
                        round((now[1] - prev[1]) / G / dt, 3), round(min(1.0, (now[2] - prev[2]) / 1e3 / dt), 3)])
        prev, last = now, t
    return out


def write_speed(work: Path, nbytes: int, method: str) -> float:
    """Bytes/s written to the work directory's disk: 64 MiB blocks of random data, fsync before the clock stops."""
    path = work / "disk-speed.bin"
    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(len(block)))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if method == "direct" else 0)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, flags, 0o644)
        try:
            for _ in range(nbytes // len(block)):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        return nbytes // len(block) * len(block) / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)


def read_speed(files: list[Path], skip: int, nbytes: int, method: str) -> tuple[float, str]:
    """(bytes/s, cache method) of a cold sequential read of `nbytes` of `files` (concatenated), about `skip` bytes
    in (the start rounded down to 4 KiB within its file, as O_DIRECT needs)."""
    cache = drop_cache(files)
    buf = mmap.mmap(-1, (64 if method == "buffered" else 8) << 20)
    done, seen = 0, 0
    t0 = time.perf_counter()
    for p in files:
        size = p.stat().st_size
        if seen + size <= skip:
            seen += size
            continue
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if method == "direct" else 0))
        try:
            pos = max(0, skip - seen) // 4096 * 4096
            seen += size
            while done < nbytes and (n := os.preadv(fd, [buf], pos)) > 0:
                done, pos = done + n, pos + n
        finally:
            os.close(fd)
        if done >= nbytes:
            break
    if done < nbytes:
        raise SystemExit(f"read probe wanted {nbytes} bytes from {skip} on, the files hold only {done}")
    return done / (time.perf_counter() - t0), cache


def probe(cold: list[Path], skip: int, work: Path, nbytes: int) -> tuple[dict[str, float], str]:
    """All four probes: {"read_buffered": B/s, "read_direct", "write_buffered", "write_direct"}, cache method."""
    out: dict[str, float] = {}
    cache = ""
    for m in METHODS:
        out[f"read_{m}"], cache = read_speed(cold, skip, nbytes, m)
    for m in METHODS:
        out[f"write_{m}"] = write_speed(work, nbytes, m)
    return out, cache


def _row(r: dict, note: str) -> str:
    c, d, ck = r["compile"], r["disk"], r["checkpoint"]
    load = r.get("load_average", {}).get("max_1min_during")
    return (f"| {r['date']} | {ck['layers']} | {ck['input_bytes'] / G:.2f} / {ck['output_bytes'] / G:.2f} | "
            f"{d['read_bytes_per_s'] / G:.2f} / {d['write_bytes_per_s'] / G:.2f} | {c['io_floor_s']:.1f} | "
            f"{c['wall_s']:.1f} | {c['ratio']:.2f} | {c['ru_maxrss_bytes'] / 2**30:.2f} | "
            f"{c['peak_anon_rss_bytes'] / 2**30:.2f} | {'-' if load is None else f'{load:.1f}'} | "
            f"{r.get('verify', 'full')} | {note} |")


def _probes(d: dict) -> str:
    p = d.get("probes", {})
    if not isinstance(p.get("before"), dict):
        return ""
    cell = " / ".join(f"{k.replace('_', ' ')} {p['before'][k] / G:.2f}, {p['after'][k] / G:.2f}" for k in p["before"])
    return f"| disk probes before, after (GB/s) | {cell} |\n"


SUMMARY = """Reading the result: the compile reads each input byte once (O_DIRECT; sha256 from the same bytes; the pass
starts on the embedding's shard while headers are parsed and the plan is built) and writes each output byte once
(O_DIRECT through aligned staging buffers, `formats/datafile.py`), so it is disk-bound. This disk shares one budget
between reads and writes (an 8 GB read and a 7 GB write took 16.9 s together against 10.1 + 6.0 s apart), which is
why the floor adds the two times, and why re-reading the output in the background during the compile would only
take bandwidth from the compile's own I/O. The final check therefore defaults to `--verify sample`: every
structural rule of `ft verify` (V1-V19), then checksums and padding of a 256 MiB sample re-read from disk (the last
and first region of each data file, the last and first record of each expert bank, random others) and of every side
file, all before the output is renamed into place; `--verify full` (verify column) re-reads everything, as `ft
verify` does at any time. The disk's speed drifts by tens of percent within minutes and 3 other jobs share the 2
cores (the compile needs ~50 s of CPU, 19 s of it sha256), so single runs scatter: compare several."""
SUMMARY_QUANTIZE = """Reading the result: the same single pass (each input byte read once, sha256 from the same bytes,
each output byte written once), with every expert of the BF16 source quantized to NVFP4 on the way, on the host's
cores (`compiler/quant`): on few cores that, not the disk, sets the wall time (`quantize_speed*.md`,
`compile_stages.md`). The floor is the same: input read plus output written at the disk's measured speeds."""


def render(r: dict) -> str:
    c, d, m, ck, la = r["compile"], r["disk"], r["machine"], r["checkpoint"], r["load_average"]
    x = r.get("extrapolated_40_layers")
    extra = "" if x is None else f"""
Extrapolated to the full 40 layers ({x['input_bytes_per_layer'] / 2**20:.0f} MiB in, \
{x['output_bytes_per_layer'] / 2**20:.0f} MiB out
per layer): input {x['input_bytes'] / G:.1f} GB, output {x['output_bytes'] / G:.1f} GB, \
I/O floor {x['io_floor_s']:.0f} s,
expected wall {x['wall_s_at_measured_ratio']:.0f} s at the measured ratio.
"""
    older = "".join(_row(o, "older" + (f": {o['note']}" if o.get("note") else "")) + "\n" for o in r.get("older", []))
    note = f"this run{': ' + r['note'] if r.get('note') else ''}"
    return f"""# `ft checkpoint` compile benchmark

- date: {r['date']}
- machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM; {m['platform']}
- load average (1/5/15 min) before {'/'.join(f'{v:.2f}' for v in la['before'])}, \
after {'/'.join(f'{v:.2f}' for v in la['after'])}, \
highest 1-min during the compile {la['max_1min_during']:.2f} (the machine is shared)
- command: `{r['command']}`
- compile: `{r['compile_command']}` (fresh process, page cache dropped first)
- read probe: {d['read_probe']}
- fused-layout BF16 sources (tensors over the window, read once): benchmarks/compile_read_once.md

Input: synthetic {ck['preset']} {_source(ck)}{'' if ck['layers'] == 40 else f' cut to {ck["layers"]} of 40 layers'}.

| quantity | value |
|---|---|
| input / output | {ck['input_bytes'] / G:.2f} GB / {ck['output_bytes'] / G:.2f} GB |
| disk read (cold) / write (fsync): faster method, mean of probes before and after \
| {d['read_bytes_per_s'] / G:.2f} GB/s / {d['write_bytes_per_s'] / G:.2f} GB/s |
{_probes(d)}| I/O floor (read input + write output) | {c['io_floor_s']:.1f} s |
| compile wall time (incl. final check `--verify {r.get('verify', 'full')}`) / CPU time \
| {c['wall_s']:.1f} s / {c['cpu_s']:.1f} s |
| wall / floor (target <= 1.3) | **{c['ratio']:.2f}** |
| peak RSS, ru_maxrss (target < 4 GB) | {c['ru_maxrss_bytes'] / G:.2f} GB ({c['ru_maxrss_bytes'] / 2**30:.2f} GiB) |
| peak anonymous / file-backed RSS (sampled) \
| {c['peak_anon_rss_bytes'] / 2**30:.2f} GiB / {c['peak_file_rss_bytes'] / 2**30:.2f} GiB |
{extra}
{SUMMARY_QUANTIZE if ck.get("quantize") else SUMMARY}

## All results (newest first)

Rows before 2026-12-02 17:50 UTC: buffered output writes, and a write probe of the buffered path only.

| date | layers | in / out GB | read / write GB/s \
| floor s | wall s | ratio | ru_maxrss GiB | anon RSS GiB | load | verify | note |
|---|---|---|---|---|---|---|---|---|---|---|---|
{_row(r, note)}
{older}"""


def _source(ck: dict) -> str:
    if ck.get("quantize"):
        return f"BF16 (fused experts, as released), compiled with `--quantize {ck['quantize']}`"
    return ("NVFP4 (ModelOpt MIXED_PRECISION layout: NVFP4 experts/shared experts/lm_head, FP8\n"
            "attention and GDN projections, BF16 rest)")
