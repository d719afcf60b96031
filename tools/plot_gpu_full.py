"""Draw benchmarks/gpu_full.json as one SVG: decode tok/s at batch 1 of each full-model row, ours beside the peer.

    python tools/plot_gpu_full.py [--json benchmarks/gpu_full.json] [--out benchmarks/gpu_full.svg]

A row is (model, placement, routing): every expert resident, or a VRAM budget (the default scheduler, decode after
256 tokens: `decode_warm`), uniform or skewed routing (the run's --routing). Each row shows the latest run that
measured it, with that run's date. The peer is llama.cpp on the same machine and geometry (what `vs_llama_cpp`
divides by), or for qwen3.6 at 8 GiB FreeToken's own 8 GB-laptop figure (`PEERS`). Resident rows also show the
physical bound the run measured (bytes a step reads at the HBM rate: `bound_ms`); the budget rows' bounds are in
benchmarks/gpu_full.md. Variant rows (`--variants`) are left out, and so are runs on another GPU than `--gpu` (the
peer's numbers are the H200's).
"""

from __future__ import annotations

import argparse
import html
import json
from dataclasses import dataclass
from pathlib import Path

# peers the JSON does not carry: (model, placement) -> (name, tok/s), from the peer table of the project's reference
PEERS = {("qwen3.6-35b-a3b", "8 GiB"): ("FreeToken", 39.3)}
SHORT = {"qwen3moe-35b-geom": "geom", "qwen3.6-35b-a3b": "qwen3.6"}


@dataclass(frozen=True)
class Row:
    model: str
    placement: str  # "resident" or "8 GiB", ...
    routing: str  # uniform | skewed
    tok_s: float
    date: str
    peer: tuple[str, float] | None = None
    bound_tok_s: float | None = None

    @property
    def label(self) -> str:
        return f"{SHORT.get(self.model, self.model)}, {self.placement}, {self.routing}"


def rows(runs: list[dict], gpu: str = "NVIDIA H200") -> list[Row]:
    """The latest measurement of each (model, placement, routing) over the runs on `gpu`, in first-seen order; a run
    marked "superseded" (it measured code removed since) is left out."""
    latest: dict[tuple, Row] = {}
    for run in (r for r in runs if not r.get("superseded") and r.get("gpu", gpu) == gpu):
        routing = "skewed" if "--routing skewed" in run.get("command", "") else "uniform"
        date = run.get("date", "")[:10]
        for model, v in run.get("models", {}).items():
            for d in v.get("decode", []) if isinstance(v.get("decode"), list) else []:
                if d.get("batch") == 1 and d.get("tok_s"):
                    peer = ("llama.cpp", d["tok_s"] / d["vs_llama_cpp"]) if d.get("vs_llama_cpp") else None
                    bound = 1e3 / d["bound_ms"] if d.get("bound_ms") else None
                    latest[(model, "resident", routing)] = Row(model, "resident", routing, d["tok_s"], date, peer,
                                                               bound)
                    break  # the shortest context comes first
            for b in v.get("budgets", []):
                warm = b.get("decode_warm") or {}
                if b.get("variant") or not warm.get("tok_s"):
                    continue
                place = f"{b['budget_gib']:g} GiB"
                peer = ("llama.cpp", warm["tok_s"] / warm["vs_llama_cpp"]) if warm.get("vs_llama_cpp") else None
                latest[(model, place, routing)] = Row(model, place, routing, warm["tok_s"], date,
                                                      peer or PEERS.get((model, place)))
    return list(latest.values())


def svg(rows: list[Row]) -> str:
    """Two panels, each on its own scale (every expert resident; at a VRAM budget), one group of horizontal bars per
    row: ours (dark), the peer (light), the bound (dashed outline) where known; the run's date at the right."""
    bar, gap, width = 14, 10, 460
    left = 12 + 7 * max(len(r.label) for r in rows)
    parts = ['<text x="10" y="18" font-size="13" font-weight="bold">Decode tok/s at batch 1, full 40-layer models, '
             'one H200 (a VRAM budget emulates a smaller card)</text>']
    y = 30
    for title, panel in (("every expert in VRAM", [r for r in rows if r.placement == "resident"]),
                         ("at a VRAM budget, after 256 tokens", [r for r in rows if r.placement != "resident"])):
        if not panel:
            continue
        parts.append(f'<text x="10" y="{y + 12}" font-size="12" font-style="italic">{title}</text>')
        y += 20
        scale = width / max(max(r.tok_s, r.peer[1] if r.peer else 0, r.bound_tok_s or 0) for r in panel)
        for r in panel:
            group = [("ft", r.tok_s, "#1f4e79", None)]
            if r.peer:
                group.append((r.peer[0], r.peer[1], "#9dc3e6", None))
            if r.bound_tok_s:
                group.append(("bound", r.bound_tok_s, "none", "#1f4e79"))
            mid = y + bar * len(group) / 2 + 4
            parts.append(f'<text x="{left - 8}" y="{mid}" font-size="12" text-anchor="end">{html.escape(r.label)}'
                         f'</text><text x="{left + width + 90}" y="{mid}" font-size="10" fill="#777">{r.date}</text>')
            for name, value, fill, stroke in group:
                line = f' stroke="{stroke}" stroke-dasharray="3 2"' if stroke else ""
                parts.append(f'<rect x="{left}" y="{y}" width="{value * scale:.1f}" height="{bar - 2}" '
                             f'fill="{fill}"{line}/><text x="{left + value * scale + 4:.1f}" y="{y + bar - 4}" '
                             f'font-size="11">{html.escape(name)} {value:,.1f}</text>')
                y += bar
            y += gap
        y += 6
    for note in ("llama.cpp: the same machine and geometry (-ncmoe at a budget); FreeToken: its own figure on an "
                 "8 GB laptop GPU;", "bound: the bytes a step reads at the run's HBM rate (the budget rows' bounds: "
                 "benchmarks/gpu_full.md). Data: benchmarks/gpu_full.json, tools/plot_gpu_full.py."):
        parts.append(f'<text x="10" y="{y + 8}" font-size="10" fill="#555">{html.escape(note)}</text>')
        y += 13
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 170}" height="{y + 4}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{"".join(parts)}</svg>\n')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path("benchmarks/gpu_full.json"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/gpu_full.svg"))
    ap.add_argument("--gpu", default="NVIDIA H200", help="the runs drawn: this GPU's (torch's device name)")
    args = ap.parse_args()
    found = rows(json.loads(args.json.read_text()), args.gpu)
    if not found:
        raise SystemExit(f"{args.json}: no decode rows to draw")
    args.out.write_text(svg(found))
    for r in found:
        peer = f", {r.peer[0]} {r.peer[1]:.1f}" if r.peer else ""
        print(f"{r.label}: {r.tok_s:.1f} tok/s ({r.date}{peer})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
