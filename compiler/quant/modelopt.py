"""Which quantization a checkpoint declares, and which scheme each linear is expected to carry.

Supported: unquantized checkpoints, gpt-oss MXFP4 (`quant_method: "mxfp4"`: the expert bank's blocks and scales,
read by `ft.compiler.experts.GptOssExperts`; every linear stays plain), and NVIDIA ModelOpt exports (`config.json` →
`quantization_config` with `quant_method: "modelopt"`, and/or the legacy `hf_quant_config.json`) whose algorithms are
NVFP4 / W4A16_NVFP4 (E2M1 codes + e4m3 block-16 scales + fp32 global), FP8 per-tensor, or MIXED_PRECISION of those.
Everything else is refused here, before any tensor is read, with one message listing what is supported.

Per-module schemes are still read off the tensors themselves (`linear.sniff`); this module only says which schemes
the declaration allows for a module, so a checkpoint that contradicts its own config is refused by name.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ft.compiler.errors import CheckpointError

# ModelOpt quant_algo -> the scheme of the stored weights ("nvfp4": packed E2M1; "fp8": e4m3 per-tensor scale)
ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8"}
SUPPORTED = ("unquantized bf16/fp16/fp32, quant_method 'modelopt' with quant_algo NVFP4, W4A16_NVFP4, "
             "FP8 (per-tensor) or MIXED_PRECISION of these, or quant_method 'mxfp4' (gpt-oss experts)")


@dataclass(frozen=True)
class QuantDecl:
    """The checkpoint's declared quantization. `source` is recorded verbatim in manifest.quant.source."""

    source: dict | None
    default: str  # scheme of modules not excluded ("plain" when unquantized or MIXED_PRECISION)
    layers: dict[str, str]  # MIXED_PRECISION: module path -> scheme
    excluded: tuple[str, ...]  # fnmatch patterns of modules left unquantized

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
        if self.layers or any(fnmatch.fnmatchcase(p, pat)
                              for p in _self_and_ancestors(module) for pat in self.excluded):
            return {"plain"}
        # ModelOpt leaves routers, lm_head, conv1d etc. unquantized by default without listing them
        return {self.default, "plain"}


def _self_and_ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


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
