"""What `ft inspect` reports: parameter counts and bytes by kind, computed from the manifest alone."""

from __future__ import annotations

from typing import Any

from .kernels import describe
from .reader import FtwReader

# Components / tensor suffixes that hold scales, not parameters.
_SCALE_SUFFIXES = ("_scale", "_scale_2", ".weight_scale", ".weight_scale_2", ".input_scale")
# Per scheme: parameters stored per byte of a code tensor (NVFP4 packs two 4-bit codes per byte).
_PARAMS_PER_CODE_BYTE = {"nvfp4": 2, "mxfp4": 2}


def _is_scale(name: str) -> bool:
    return name.endswith(_SCALE_SUFFIXES)


def summarize(r: FtwReader) -> dict[str, Any]:
    m, cfg = r.records, r.config
    linears = r.quant.get("linears", {})
    dense_params = dense_bytes = 0
    for t in m.tensors.values():
        dense_bytes += t.nbytes
        if _is_scale(t.name):
            continue
        module = t.name.rsplit(".", 1)[0]
        per = _PARAMS_PER_CODE_BYTE.get(linears.get(module, ""), 0)
        dense_params += t.nbytes * per if per and t.name.endswith(".weight") else _numel(t.shape)
    expert_params = expert_bytes = 0
    schemes: dict[str, int] = {}
    for b in m.banks.values():
        expert_bytes += b.nbytes
        schemes[b.scheme] = schemes.get(b.scheme, 0) + 1
        per = _PARAMS_PER_CODE_BYTE.get(b.scheme, 0)
        one = sum((c.nbytes * per if per and c.dtype == "U8" else _numel(c.shape))  # codes: 2 per byte; biases
                  for c in b.components if not _is_scale(c.name))
        expert_params += one * b.num_experts
    asset_bytes = sum(a.nbytes for a in m.assets.values())
    active_experts = expert_params * cfg.num_experts_per_tok // cfg.num_experts if cfg.num_experts else 0
    return {
        "path": str(r.path),
        "format_version": r.manifest["version"],
        "family": cfg.family,
        "parameters": {"total": dense_params + expert_params, "dense": dense_params, "experts": expert_params,
                       "active_per_token": dense_params + active_experts},
        "layers": {"total": cfg.num_layers, "moe": cfg.num_moe_layers,
                   "linear_attention": cfg.layer_types.count("linear_attention"),
                   "full_attention": cfg.layer_types.count("full_attention"),
                   "sliding_attention": cfg.layer_types.count("sliding_attention"),
                   "mla_attention": cfg.layer_types.count("mla_attention")},
        "experts": {"per_layer": cfg.num_experts, "per_token": cfg.num_experts_per_tok,
                    "shared_expert_intermediate": cfg.shared_expert_intermediate_size,
                    "bytes_per_expert": {b.name: b.stride for b in list(m.banks.values())[:1]}},
        "formats": {"expert_banks": schemes, "linears": _count(linears.values()),
                    "dense_dtypes": _count(t.dtype for t in m.tensors.values())},
        "bytes": {"dense": dense_bytes, "experts": expert_bytes, "assets": asset_bytes,
                  "data_files": sum(f.nbytes for f in m.files), "num_data_files": len(m.files)},
        "plans": [a.name for a in m.slots["plans"]],
        "placement_plans": _plans(r),
        "kernels": [a.name for a in m.slots["kernels"]],
        "kernel_sets": describe(r),
        "provenance": {k: v for k, v in r.provenance.items() if k != "files"},
        "num_source_files": len(r.provenance.get("files", {})),
    }


def _plans(r: FtwReader) -> list[dict[str, Any]]:
    """One line of facts per placement plan (`plans/<name>.json`), or why it cannot be read."""
    from . import errors as E
    from .plan import plan_names, read_plan

    out = []
    for name in plan_names(r):
        try:
            p = read_plan(r, name)
        except E.FtwError as e:
            out.append({"name": name, "error": str(e)})
            continue
        out.append({"name": name, "gpu": p.machine.gpu, "vram_budget": p.vram.budget,
                    "host_memory": p.machine.host_memory, "expert_slots": p.vram.expert_slots,
                    "kv_tokens": p.vram.kv_tokens, "routing": p.routing.source,
                    "decode_tok_s": p.prediction.decode_tok_s, "prefill_tok_s": p.prediction.prefill_tok_s})
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out
