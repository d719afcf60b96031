"""Shared builders for the FTW format tests: tiny configs, small valid FTWs, manifest rewriting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from ft.formats import FtwWriter, ModelConfig
from ft.formats.layout import HEADER_SIZE, INDEX_NAME, Header

NO_QUANT = {"linears": {}, "experts": None, "source": None}


def tiny_config(**over: Any) -> ModelConfig:
    """The smallest valid config: one dense full-attention layer (also the spec's worked example)."""
    kw: dict[str, Any] = dict(
        family="qwen3_moe", vocab_size=4, hidden_size=2, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
        rms_norm_eps=1e-6, rope_theta=10000.0, rotary_dim=2, max_position_embeddings=16,
        layer_types=("full_attention",), mlp_types=("dense",), attn_qkv_bias=False, attn_qk_norm=False,
        attn_output_gate=False, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False,
        shared_expert_intermediate_size=0, intermediate_size=4, linear_num_key_heads=0, linear_num_value_heads=0,
        linear_key_head_dim=0, linear_value_head_dim=0, linear_conv_kernel_dim=0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(3,))
    kw.update(over)
    return ModelConfig(**kw)


def moe_config(**over: Any) -> ModelConfig:
    """A one-layer MoE config with 4 experts of hidden 32 / intermediate 16."""
    kw: dict[str, Any] = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=8, vocab_size=64,
                              mlp_types=("moe",), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              intermediate_size=0, norm_topk_prob=True, attn_qk_norm=True)
    kw.update(over)
    return tiny_config(**kw)


def finish(w: FtwWriter, config: ModelConfig | None = None, **kw: Any) -> Path:
    args: dict[str, Any] = dict(config=config or tiny_config(), quant=NO_QUANT, tokenizer={}, generation={},
                                provenance={})
    args.update(kw)
    return w.finish(**args)


def worked_example(out: Path) -> Path:
    """The two-tensor FTW of the spec's worked example (specs/ftw.md, "Worked example")."""
    w = FtwWriter(out)
    w.add_tensor("a", torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32))
    w.add_tensor("b", torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16))
    return w.finish(config=tiny_config(), quant=NO_QUANT, tokenizer={}, generation={},
                    provenance={"source": "example/tiny", "revision": None, "files": {}, "compiler": "ft 0.1.0"})


def small_ftw(out: Path, *, shard_bytes: int = 1 << 30) -> Path:
    """Two tensors, one 4-expert fp32 bank, one asset and one plans/ entry.

    Default layout, one data file data-00000.ftd: `t.f32` [3, 5] at 0, `t.bf16` [7] at 4096, bank `bank` at 8192
    (stride 4096, components `w` f32 [8, 4] at 0 and `s` f32 [8] at 256), 24576 bytes in all. With
    shard_bytes=8192 the bank moves to offset 0 of data-00001.ftd.
    """
    g = torch.Generator().manual_seed(0)
    w = FtwWriter(out, shard_bytes=shard_bytes)
    w.add_tensor("t.f32", torch.randn(3, 5, generator=g))
    w.add_tensor("t.bf16", torch.randn(7, generator=g).to(torch.bfloat16))
    bank = w.add_expert_bank("bank", "fp32", 4, {"w": (torch.float32, (8, 4)), "s": (torch.float32, (8,))})
    for e in range(4):
        bank.write_expert(e, {"w": torch.randn(8, 4, generator=g), "s": torch.randn(8, generator=g)})
    w.add_asset("tokenizer.json", b'{"version": "1.0"}')
    w.add_asset("tiny.plan", b"plan-bytes", slot="plans")
    return finish(w, moe_config(), quant={"linears": {}, "experts": "fp32", "source": None},
                  tokenizer={"file": "tokenizer.json", "chat_template": None})


def read_manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / INDEX_NAME).read_bytes()[HEADER_SIZE:])


def write_manifest(d: Path, m: Any, *, raw: bytes | None = None) -> None:
    """Replace the manifest (a JSON value, or raw bytes) and re-pack a consistent header around it."""
    body = raw if raw is not None else json.dumps(m, separators=(",", ":")).encode()
    (d / INDEX_NAME).write_bytes(Header.for_manifest(body).pack() + body)


def edit_manifest(d: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Apply `fn` to the decoded manifest in place (its return value is ignored) and re-pack the header."""
    m = read_manifest(d)
    fn(m)
    write_manifest(d, m)


def patch_bytes(p: Path, offset: int, data: bytes) -> None:
    raw = bytearray(p.read_bytes())
    raw[offset:offset + len(data)] = data
    p.write_bytes(bytes(raw))
