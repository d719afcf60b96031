"""Which quantization a checkpoint declares, and which scheme each linear is expected to carry.

Supported: unquantized checkpoints, gpt-oss MXFP4 (`quant_method: "mxfp4"`: the expert bank's blocks and scales,
read by `experts_gpt_oss.GptOssExperts`; every linear stays plain), and NVIDIA ModelOpt exports (`config.json` →
`quantization_config` with `quant_method: "modelopt"`, and/or the legacy `hf_quant_config.json`) whose algorithms are
NVFP4 / W4A16_NVFP4 (E2M1 codes + e4m3 block-16 scales + fp32 global), FP8 per-tensor, or MIXED_PRECISION of those,
and block-scaled FP8 releases (`quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [128, 128]`: DeepSeek-V3,
Qwen3-*-FP8, GLM-*-FP8; `scale_fmt` "float" or "ue8m0" (E8M0 power-of-two scales, DeepSeek-V4); `expert_dtype`
"fp8" or "fp4" (DeepSeek-V4's routed experts: E2M1 pairs with an E8M0 scale per 32 inputs, scheme `mxfp4`, for the
modules under an `experts.` path; V4 writes `expert_dtype` at the top level of config.json, V4.1 inside the
quantization_config, and transformers moves the first into the second)), whose `modules_to_not_convert` /
`ignored_layers` use transformers' matching (a regex from the start of the module path up to a module boundary, or a
suffix). Everything else is refused here, before any tensor
is read, with one message listing what is supported.

Per-module schemes are still read off the tensors themselves (`linear.sniff`); this module only says which schemes
the declaration allows for a module, so a checkpoint that contradicts its own config is refused by name.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass

from ft.compiler.errors import CheckpointError

# ModelOpt quant_algo -> the scheme of the stored weights ("nvfp4": packed E2M1; "fp8": e4m3 per-tensor scale)
ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8"}
SUPPORTED = ("unquantized bf16/fp16/fp32, quant_method 'modelopt' with quant_algo NVFP4, W4A16_NVFP4, "
             "FP8 (per-tensor) or MIXED_PRECISION of these, quant_method 'fp8' with fmt 'e4m3', "
             "weight_block_size [128, 128], scale_fmt 'float' or 'ue8m0' and expert_dtype 'fp8' or 'fp4', "
             "or quant_method 'mxfp4' (gpt-oss experts)")
EXPERT_DTYPES = {"fp8": "fp8_block", "fp4": "mxfp4"}  # block-FP8 expert_dtype -> the experts' scheme
_EXPERT = re.compile(r"(^|\.)experts(\.\d+)?(\.|$)")  # a routed expert module (not shared_experts)


@dataclass(frozen=True)
class QuantDecl:
    """The checkpoint's declared quantization. `source` is recorded verbatim in manifest.quant.source."""

    source: dict | None
    default: str  # scheme of modules not excluded ("plain" when unquantized or MIXED_PRECISION)
    layers: dict[str, str]  # MIXED_PRECISION: module path -> scheme
    excluded: tuple[str, ...]  # patterns of modules left unquantized: fnmatch, or transformers' rule (`hf_match`)
    hf_match: bool = False  # block FP8: transformers' `should_convert_module` matching instead of fnmatch
    experts: str | None = None  # block FP8: the scheme of routed expert modules (expert_dtype), else `default`

    @property
    def quantized(self) -> bool:
        return self.source is not None

    def allowed(self, module: str) -> set[str]:
        """Schemes a linear may carry: its listed one (or plain), the global one or plain unless excluded."""
        if not self.quantized:
            return {"plain"}
        for path in _self_and_ancestors(module):
            if path in self.layers:
                return {self.layers[path]}
        if self.hf_match:
            if _hf_excluded(module, self.excluded):
                return {"plain"}
            return {self.experts or self.default, "plain"} if _EXPERT.search(module) else {self.default, "plain"}
        if self.layers or any(fnmatch.fnmatchcase(p, pat)
                              for p in _self_and_ancestors(module) for pat in self.excluded):
            return {"plain"}
        # ModelOpt leaves routers, lm_head, conv1d etc. unquantized by default without listing them
        return {self.default, "plain"}


def _self_and_ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _hf_excluded(module: str, patterns: tuple[str, ...]) -> bool:
    """transformers' rule: a pattern as a regex from the start of the path ending at a module boundary ("layers.1"
    matches "layers.1.mlp", not "layers.11"; "mlp.gate" not "mlp.gate_proj"), or a plain suffix of the path."""
    return bool(patterns) and (bool(_hf_regex(patterns).match(module)) or module.endswith(patterns))


@functools.cache
def _hf_regex(patterns: tuple[str, ...]) -> re.Pattern:
    """All patterns as one alternation (matches iff one of them does: the boundary is tried after each)."""
    return re.compile("(?:" + "|".join(f"(?:{p})" for p in patterns) + r")(?:(?<=\.)|(?=\.|$))")


def _fp8_block(qc: dict, where: str) -> QuantDecl:
    """quant_method 'fp8' (transformers' FineGrainedFP8Config): e4m3 weights with 128x128 float32 tile scales."""
    fmt, block = qc.get("fmt", "e4m3"), qc.get("weight_block_size")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: FP8 fmt {fmt!r} is not supported; supported: 'e4m3'")
    if block is None or list(block) != [128, 128]:
        raise CheckpointError(f"{where}: FP8 weight_block_size {block!r} is not supported; supported: [128, 128]")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise CheckpointError(f"{where}: FP8 activation_scheme {qc.get('activation_scheme')!r} is not supported; "
                              "supported: 'dynamic', 'static' (weights are read alone either way)")
    if (qc.get("scale_fmt") or "float") not in ("float", "ue8m0"):
        raise CheckpointError(f"{where}: FP8 scale_fmt {qc.get('scale_fmt')!r} is not supported; supported: 'float' "
                              "(F32 weight_scale_inv), 'ue8m0' (E8M0 power-of-two scales)")
    expert_dtype = qc.get("expert_dtype") or "fp8"
    if expert_dtype not in EXPERT_DTYPES:
        raise CheckpointError(f"{where}: FP8 expert_dtype {expert_dtype!r} is not supported; supported: 'fp8', "
                              "'fp4' (E2M1 experts with E8M0 scales per 32 inputs)")
    if expert_dtype == "fp4" and (qc.get("scale_fmt") or "float") != "ue8m0":
        raise CheckpointError(f"{where}: FP8 expert_dtype 'fp4' with scale_fmt {qc.get('scale_fmt')!r} is not "
                              "supported; FP4 experts carry E8M0 scales (scale_fmt 'ue8m0')")
    if qc.get("modules_to_convert"):
        raise CheckpointError(f"{where}: FP8 modules_to_convert (quantized embeddings) is not supported")
    excluded = qc.get("modules_to_not_convert")
    excluded = qc.get("ignored_layers") if excluded is None else excluded
    excluded = [] if excluded is None else excluded
    if not isinstance(excluded, list) or not all(isinstance(p, str) for p in excluded):
        raise CheckpointError(f"{where}: 'modules_to_not_convert'/'ignored_layers' must be a list of module names")
    for pat in excluded:
        try:
            re.compile(pat)
        except re.error as e:
            raise CheckpointError(f"{where}: module pattern {pat!r} is not a valid regex ({e})") from None
    return QuantDecl(qc, "fp8_block", {}, tuple(excluded), hf_match=True, experts=EXPERT_DTYPES[expert_dtype])


def _algo(value, where: str) -> str:
    if value not in ALGOS:
        raise CheckpointError(f"{where}: quant_algo {value!r} is not supported; supported: {SUPPORTED}")
    return ALGOS[value]


def _check_group(q: dict, where: str) -> None:
    gs = q.get("group_size")
    if gs is not None and gs != 16:
        raise CheckpointError(f"{where}: NVFP4 group_size {gs} is not supported (ModelOpt NVFP4 uses 16)")


def parse_quant(config: dict, hf_quant: dict | None) -> QuantDecl:
    """Read `config.json`'s quantization_config (preferred) or `hf_quant_config.json`."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is not None:
        where = "config.json quantization_config"
        if not isinstance(qc, dict):
            raise CheckpointError(f"{where}: expected an object")
        method = qc.get("quant_method")
        if method == "mxfp4":  # gpt-oss: only the experts' *_blocks/*_scales are quantized; every linear is plain
            if config.get("model_type") != "gpt_oss":
                raise CheckpointError(f"{where}: quant_method 'mxfp4' is supported for gpt_oss checkpoints only, "
                                      f"not model_type {config.get('model_type')!r}")
            return QuantDecl(qc, "plain", {}, ())
        if method == "fp8":
            top = config.get("expert_dtype")  # DeepSeek-V4's place for it; transformers moves it into the config
            return _fp8_block(qc if top is None or "expert_dtype" in qc else dict(qc, expert_dtype=top), where)
        if method != "modelopt":
            raise CheckpointError(f"{where}: quant_method {method!r} is not supported; supported: {SUPPORTED}")
        source, algo = qc, qc.get("quant_algo")
        layers_raw = qc.get("quantized_layers")
        excluded = qc.get("ignore") or qc.get("exclude_modules") or []
    elif hf_quant is not None:
        where = "hf_quant_config.json"
        producer = (hf_quant.get("producer") or {}).get("name")
        q = hf_quant.get("quantization")
        if producer != "modelopt" or not isinstance(q, dict):
            raise CheckpointError(f"{where}: producer {producer!r} is not supported; supported: {SUPPORTED}")
        source, algo = hf_quant, q.get("quant_algo")
        layers_raw = q.get("quantized_layers")
        excluded = q.get("exclude_modules") or []
        qc = q
    else:
        return QuantDecl(None, "plain", {}, ())
    if not isinstance(excluded, list) or not all(isinstance(p, str) for p in excluded):
        raise CheckpointError(f"{where}: 'ignore'/'exclude_modules' must be a list of module patterns")
    if algo == "MIXED_PRECISION":
        if not isinstance(layers_raw, dict) or not layers_raw:
            raise CheckpointError(f"{where}: MIXED_PRECISION without a 'quantized_layers' map")
        layers = {}
        for path, spec in sorted(layers_raw.items()):
            a = spec.get("quant_algo") if isinstance(spec, dict) else None
            layers[path] = _algo(a, f"{where} quantized_layers[{path!r}]")
            if layers[path] == "nvfp4":
                _check_group(spec, f"{where} quantized_layers[{path!r}]")
        return QuantDecl(source, "plain", layers, tuple(excluded))
    scheme = _algo(algo, where)
    if scheme == "nvfp4":
        _check_group(qc, where)
    return QuantDecl(source, scheme, {}, tuple(excluded))
