"""gpt_oss synthetic checkpoints, written by transformers' own `save_pretrained` (tiny / small presets).

The GptOssForCausalLM of the preset's config gets seeded values (below) and is saved by transformers, which writes the
plain layout: `mlp.experts.gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]` (in x out) with their biases. With
`quant="mxfp4"` the experts are quantized like the release (`ft.formats.quant.mxfp4.quantize` of the [E, out, in]
transpose), the model is given the exact dequantized values and saved again as the twin (`<out>-twin`), and the
checkpoint's shards are rewritten with `*_blocks [E, out, in/32, 16]` / `*_scales [E, out, in/32]` in place of the
expert weights, plus the release's `quantization_config`. config.json is rewritten in the release's style (legacy
`rope_theta` + `rope_scaling`, `experts_per_token`, `initial_context_length`, `torch_dtype`).

Values (seeded per tensor name): embeddings N(0, 1) so that each token's own row dominates the residual stream (the
routers then see token-dependent inputs); input projections, routers and experts' gate_up N(0, 1/fan_in); projections
into the residual (o_proj, experts' down) scaled by 0.5/sqrt(L); biases N(0, 0.1²); sinks N(0, 1); norms 1 + N(0,
0.05²).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ft.compiler.synth.routing import name_seed
from ft.compiler.synth.tokenizer import write_tokenizer_files
from ft.formats.quant import mxfp4

QUANT_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def gpt_oss_config(keys: dict, tok: dict, dtype: torch.dtype):
    """transformers' GptOssConfig from preset keys (legacy rope keys turned into rope_parameters)."""
    from transformers import GptOssConfig

    keys = dict(keys)
    rope = {"rope_type": "yarn", "rope_theta": float(keys.pop("rope_theta", 150_000.0)),
            **keys.pop("rope_scaling", {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 4096})}
    rope.pop("type", None)
    ids = tok["special_tokens"]
    cfg = GptOssConfig(**keys, rope_parameters=rope, bos_token_id=ids["<|startoftext|>"],
                       eos_token_id=ids["<|return|>"], pad_token_id=ids["<|endoftext|>"])
    cfg.architectures = ["GptOssForCausalLM"]
    cfg.dtype = dtype
    return cfg


def harmony_tokenizer(out: Path, keys: dict, num_ranks: int | None) -> tuple[dict, dict]:
    """Write the tokenizer files; -> (tokenizer info, keys with the vocab size: the tokenizer's for truncated ranks)."""
    tok = write_tokenizer_files(out, "harmony", num_ranks)
    if num_ranks is not None:
        return tok, dict(keys, vocab_size=tok["vocab_size"])
    if keys["vocab_size"] < tok["vocab_size"]:
        raise ValueError(f"vocab_size {keys['vocab_size']} is smaller than the tokenizer ({tok['vocab_size']} ids)")
    return tok, keys


def value(name: str, shape: tuple[int, ...], num_layers: int, seed: int) -> torch.Tensor:
    """float32 synthetic values of one parameter (module docstring)."""
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    noise = torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * noise
    if name.endswith("sinks") or name.endswith("embed_tokens.weight"):
        return noise
    if name.endswith("bias"):
        return 0.1 * noise
    return noise * weight_std(name, shape, num_layers)


def weight_std(name: str, shape: tuple[int, ...], num_layers: int) -> float:
    """std of a projection: 1/sqrt(fan_in), times 0.5/sqrt(L) for those writing into the residual stream."""
    fan_in = shape[-2] if name.endswith(_EXPERTS) else shape[-1]  # experts are [E, in, out]
    residual = name.endswith(("o_proj.weight", "experts.down_proj"))
    return 1.0 / math.sqrt(fan_in) * (0.5 / math.sqrt(num_layers) if residual else 1.0)


def build_gpt_oss(*, preset, keys: dict, dtype: torch.dtype, quant: str, seed: int, shard: int, out: Path,
                  twin: Path | None) -> None:
    """Write the checkpoint into `out` (and, for mxfp4 with a twin directory, the exact plain twin into `twin`).
    Full-size presets are streamed (`synth.gpt_oss_stream`)."""
    from transformers import GptOssForCausalLM

    from ft.compiler.synth.presets import TINY_RANKS

    num_ranks = TINY_RANKS if preset.name == "tiny" else None
    if preset.kind == "stream":
        from ft.compiler.synth.build import _console, _progress
        from ft.compiler.synth.gpt_oss_stream import write_gpt_oss_stream

        with _progress(_console()) as progress:
            task = progress.add_task(f"gpt_oss {preset.name}", total=None)
            write_gpt_oss_stream(keys=keys, dtype=dtype, quant=quant, seed=seed, shard=shard, out=out, twin=twin,
                                 num_ranks=num_ranks, advance=lambda n: progress.advance(task, n))
        return

    from ft.compiler.synth.tables import quiet_transformers

    tok, keys = harmony_tokenizer(out, keys, num_ranks)
    cfg = gpt_oss_config(keys, tok, dtype)
    torch.manual_seed(seed)
    with quiet_transformers():
        model = GptOssForCausalLM(cfg)
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = value(name, tuple(p.shape), cfg.num_hidden_layers, seed)
            if quant == "mxfp4" and name.endswith(_EXPERTS):
                blocks, scales = mxfp4.quantize(v.transpose(1, 2))                  # [E, out, in/2], [E, out, in/32]
                quantized[name] = (blocks.unflatten(-1, (-1, 16)).contiguous(), scales.contiguous())
                v = mxfp4.dequantize(blocks, scales).transpose(1, 2)               # exact in bf16 and fp32
            p.copy_(v)
    model.to(dtype)
    gen = generation_config(tok)
    with quiet_transformers():
        if twin is not None:
            model.save_pretrained(twin, max_shard_size=shard)
            _finish_dir(twin, out, gen, dtype, None)
        model.save_pretrained(out, max_shard_size=shard)
    if quant == "mxfp4":
        _swap_experts(out, quantized)
    _finish_dir(out, None, gen, dtype, QUANT_CONFIG if quant == "mxfp4" else None)


def generation_config(tok: dict) -> dict:
    """generation_config.json as the release has it: stop on <|return|>, <|endoftext|> and <|call|>."""
    ids = tok["special_tokens"]
    return {"bos_token_id": ids["<|startoftext|>"], "do_sample": True,
            "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
            "pad_token_id": ids["<|endoftext|>"]}


def realistic_config(saved: dict, dtype: torch.dtype, quant_config: dict | None) -> dict:
    """transformers' saved config.json -> the release's form (rope_theta + rope_scaling, experts_per_token, ...)."""
    d = dict(saved)
    rope = dict(d.pop("rope_parameters", None) or {})
    d["rope_theta"] = rope.pop("rope_theta", 150_000.0)
    d["rope_scaling"] = rope
    d["experts_per_token"] = d["num_experts_per_tok"]
    d["initial_context_length"] = rope.get("original_max_position_embeddings", 4096)
    d.pop("dtype", None)
    d["torch_dtype"] = _DTYPE_NAMES[dtype]
    if quant_config is not None:
        d["quantization_config"] = quant_config
    return dict(sorted(d.items()))


def _finish_dir(path: Path, tokenizer_from: Path | None, gen: dict, dtype: torch.dtype,
                quant_config: dict | None) -> None:
    import shutil

    from ft.compiler.synth.build import TOKENIZER_FILES

    config = realistic_config(json.loads((path / "config.json").read_text()), dtype, quant_config)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_from / f, path / f)


def _swap_experts(out: Path, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Rewrite the saved shards with each expert weight replaced by its `_blocks` and `_scales` (same shard), and
    the index's weight map and total size to match."""
    from safetensors.torch import load_file, save_file

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(out.glob("*.safetensors"))
    total = 0
    for f in files:
        tensors = load_file(f)
        for name in [n for n in tensors if n in quantized]:
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantized[name]
            if index is not None:
                del index["weight_map"][name]
                index["weight_map"][f"{name}_blocks"] = index["weight_map"][f"{name}_scales"] = f.name
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = f.with_name(f.name + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        tmp.replace(f)
    if index is not None:
        index["metadata"]["total_size"] = total
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2) + "\n")
