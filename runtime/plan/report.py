"""`ft plan --report`: a plan as text, and as one self-contained HTML page with inline SVG plots (no scripts, no
external files): the per-layer expert heat map (each expert's share of its layer's routing; resident experts blue,
the others orange) and the predicted decode / prefill tok/s against the VRAM budget, the plan's budget marked."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from ft.formats.plan import Plan

GIB = 1 << 30


def summary(p: Plan) -> str:
    m, v, r, pr = p.machine, p.vram, p.routing, p.prediction
    rt = m.rates
    index = {layer: i for i, layer in enumerate(p.model.moe_layers)}
    per_layer = np.bincount(np.array([index[layer] for layer, _ in p.resident], np.int64), minlength=len(index))
    pre = f", prefill {pr.prefill_tok_s:,.0f} tok/s (bound)" if pr.prefill_tok_s is not None else ""
    lines = [
        f"plan {p.name} ({p.entry}) for {p.model.family} model {p.model.key}",
        f"machine: {m.gpu} ({m.gpu_memory / GIB:.1f} GiB), host RAM {m.host_memory / GIB:.1f} GiB, page-locking up to "
        f"{m.pinned_memory / GIB:.1f} GiB, CPU lane {'on' if m.cpu_lane else 'off'}",
        f"rates: HBM {rt.hbm_read / 1e9:.0f} GB/s, pinned H2D {rt.h2d_pinned / 1e9:.1f} GB/s, expert records "
        f"{rt.h2d_expert_pinned / 1e9:.1f} GB/s, CPU lane {rt.cpu_fixed_s * 1e6:.0f} us + "
        f"{rt.cpu_per_expert_s * 1e6:.1f} us per expert ({rt.source})",
        f"VRAM budget {v.budget / GIB:.2f} GiB: in use at start + kernel modules {v.outside / GIB:.2f}, dense "
        f"{v.dense / GIB:.2f} ({'quantized' if v.dense_quantized else 'dequantized'}), KV {v.kv / GIB:.2f} "
        f"({v.kv_tokens} tokens, {v.max_running_requests} sequences), prefill buffers {v.prefill_buffers / GIB:.2f}, "
        f"reserve {v.reserve / GIB:.2f}, expert slots {v.expert_slots} of {v.max_slots} "
        f"({100 * v.expert_slots / v.max_slots:.0f} %, {v.expert_slots * p.model.record_bytes / GIB:.2f} GiB)",
        f"routing: {r.source} ({r.detail})",
        f"resident: {len(p.resident)} experts; per MoE layer {int(per_layer.min())} to {int(per_layer.max())}",
        f"page-locked banks: {len(p.pinned_banks)} of {len(p.model.moe_layers)}; lane-only: "
        f"{', '.join(map(str, p.lane_only)) or 'none'}",
        f"prefill chunk: {p.prefill_chunk} tokens",
        f"predicted: decode {pr.decode_tok_s:.1f} tok/s at batch 1 (hit rate {pr.hit_rate:.3f}; per token "
        f"{pr.gpu_misses_per_token:.1f} misses copied by the GPU, {pr.cpu_misses_per_token:.1f} computed by the "
        f"CPU){pre}",
        "arithmetic:",
        *(f"  {line}" for line in pr.arithmetic),
    ]
    return "\n".join(lines)


def write_report(p: Plan, out_dir: str | Path) -> list[Path]:
    """plan-<name>.txt and plan-<name>.html in `out_dir` (created); returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text, page = out / f"plan-{p.name}.txt", out / f"plan-{p.name}.html"
    text.write_text(summary(p) + "\n", encoding="utf-8")
    curve = p.prediction.curve
    decode = [(b / GIB, d) for b, d, _ in curve]
    prefill = [(b / GIB, f) for b, _, f in curve if f is not None]
    charts = [_line_chart(decode, "VRAM budget (GiB)", "decode tok/s (batch 1)", p.vram.budget / GIB)]
    if prefill:
        charts.append(_line_chart(prefill, "VRAM budget (GiB)", "prefill tok/s (PCIe bound)", p.vram.budget / GIB))
    body = (f"<h1>Placement plan {html.escape(p.name)}</h1><pre>{html.escape(summary(p))}</pre>"
            f"<h2>Expert heat per MoE layer</h2><p>Each cell is one expert; darker = a larger share of its layer's "
            f"routed pairs ({html.escape(p.routing.source)} routing). Blue: resident at start; orange: not.</p>"
            f"{_heat(p)}<h2>Predicted speed against the VRAM budget</h2><p>KV held at {p.vram.kv_tokens} tokens; the "
            f"line marks this plan's budget.</p>{''.join(charts)}")
    page.write_text("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>plan "
                    f"{html.escape(p.name)}</title><style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}"
                    "pre{background:#f6f6f6;padding:1em;white-space:pre-wrap}svg{display:block;margin:1em 0}"
                    f"</style></head><body>{body}</body></html>\n", encoding="utf-8")
    return [text, page]


def _heat(p: Plan) -> str:
    L, E = len(p.model.moe_layers), p.model.num_experts
    counts = np.ones((L, E)) if p.routing.counts is None else np.asarray(p.routing.counts, np.float64)
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1e-300)
    level = np.rint(np.sqrt(share / max(share.max(), 1e-300)) * 10).astype(int)  # 0..10, sqrt: the tail shows
    resident = np.zeros((L, E), bool)
    index = {layer: i for i, layer in enumerate(p.model.moe_layers)}
    for layer, e in p.resident:
        resident[index[layer], e] = True
    cw, ch, left = max(1, min(8, 1024 // E)), max(4, min(14, 560 // L)), 70
    parts = []
    for i in range(L):
        e = 0
        while e < E:  # one rect per run of equal cells
            j = e
            while j + 1 < E and level[i, j + 1] == level[i, e] and resident[i, j + 1] == resident[i, e]:
                j += 1
            a = 0.08 + 0.092 * level[i, e]
            color = "31,119,180" if resident[i, e] else "255,127,14"
            parts.append(f'<rect x="{left + e * cw}" y="{i * ch}" width="{(j - e + 1) * cw}" height="{ch}" '
                         f'fill="rgba({color},{a:.2f})"/>')
            e = j + 1
        if L <= 64 or i % max(1, L // 32) == 0:
            parts.append(f'<text x="{left - 6}" y="{i * ch + ch - 1}" font-size="{min(11, ch)}" '
                         f'text-anchor="end">layer {p.model.moe_layers[i]}</text>')
    w, h = left + E * cw + 10, L * ch + 24
    parts.append(f'<text x="{left}" y="{L * ch + 16}" font-size="11">experts 0..{E - 1}</text>')
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">{"".join(parts)}</svg>'


def _line_chart(points: list[tuple[float, float]], xlabel: str, ylabel: str, mark: float) -> str:
    W, H, l, r, t, b = 720, 300, 70, 20, 20, 45
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x0, x1 = min(xs + [mark]), max(xs + [mark])
    y1 = max(ys) * 1.08 or 1.0
    x1 = x1 if x1 > x0 else x0 + 1

    def X(x: float) -> float:
        return l + (x - x0) / (x1 - x0) * (W - l - r)

    def Y(y: float) -> float:
        return H - b - y / y1 * (H - t - b)

    path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in points)
    ticks = []
    for k in range(6):
        xv, yv = x0 + (x1 - x0) * k / 5, y1 * k / 5
        ticks.append(f'<text x="{X(xv):.1f}" y="{H - b + 16}" font-size="11" text-anchor="middle">{xv:.1f}</text>'
                     f'<text x="{l - 6}" y="{Y(yv) + 4:.1f}" font-size="11" text-anchor="end">{yv:,.0f}</text>'
                     f'<line x1="{l}" x2="{W - r}" y1="{Y(yv):.1f}" y2="{Y(yv):.1f}" stroke="#ddd"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">{"".join(ticks)}'
            f'<line x1="{l}" x2="{l}" y1="{t}" y2="{H - b}" stroke="#333"/>'
            f'<line x1="{l}" x2="{W - r}" y1="{H - b}" y2="{H - b}" stroke="#333"/>'
            f'<line x1="{X(mark):.1f}" x2="{X(mark):.1f}" y1="{t}" y2="{H - b}" stroke="#c00" stroke-dasharray="4"/>'
            f'<polyline points="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>'
            f'<text x="{(l + W - r) / 2}" y="{H - 6}" font-size="12" text-anchor="middle">{html.escape(xlabel)}</text>'
            f'<text x="14" y="{(t + H - b) / 2}" font-size="12" text-anchor="middle" '
            f'transform="rotate(-90 14 {(t + H - b) / 2})">{html.escape(ylabel)}</text></svg>')
