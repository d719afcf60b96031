"""Random but valid NVFP4 expert records in the FTW record layout (tiny shapes, any seed)."""

from __future__ import annotations

import torch

from ft.runtime.gpu.record_layout import RecordLayout


def random_records(layout: RecordLayout, num: int, seed: int) -> torch.Tensor:
    """u8 [num, stride]: random E2M1 codes, e4m3 block scales in [1/64, 2], per-row scale_2 in [0.01, 0.1]."""
    g = torch.Generator().manual_seed(seed)
    recs = torch.randint(0, 256, (num, layout.stride), dtype=torch.uint8, generator=g)  # padding stays random too
    for e in range(num):
        r = recs[e]
        for name in ("gate_up_scale", "down_scale"):
            shape = layout.shape(name)
            vals = torch.exp2(torch.rand(shape, generator=g) * 7 - 6).to(torch.float8_e4m3fn)
            layout.view(r, name).copy_(vals)
        for name in ("gate_up_scale_2", "down_scale_2"):
            layout.view(r, name).copy_(torch.rand(layout.shape(name), generator=g) * 0.09 + 0.01)
    return recs


def random_mxfp4_records(layout: RecordLayout, num: int, seed: int) -> torch.Tensor:
    """u8 [num, stride] MXFP4 records: random E2M1 codes, E8M0 scales 2^-6 .. 2^1 (bytes 121..128), biases
    N(0, 0.5^2) on both projections where the layout has them (gpt-oss; DeepSeek-V4's FP4 experts have none)."""
    g = torch.Generator().manual_seed(seed)
    recs = torch.randint(0, 256, (num, layout.stride), dtype=torch.uint8, generator=g)  # padding stays random too
    for e in range(num):
        r = recs[e]
        for name in ("gate_up_scale", "down_scale"):
            layout.view(r, name).copy_(torch.randint(121, 129, layout.shape(name), dtype=torch.uint8, generator=g))
        for name in ("gate_up_bias", "down_bias")[: 2 if "down_bias" in layout.components else 0]:
            layout.view(r, name).copy_(torch.randn(layout.shape(name), generator=g) * 0.5)
    return recs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def tiny_moe_ftw(out, *, layers: int = 3, experts: int = 8, top_k: int = 2, hidden: int = 64, inter: int = 32,
                 seed: int = 0):
    """An FTW holding only what the experts scheduler reads: routers and NVFP4 expert banks (random, valid)."""
    from ft.formats import FtwWriter, ModelConfig

    cfg = ModelConfig(
        family="qwen3_moe", vocab_size=16, hidden_size=hidden, num_layers=layers, num_heads=2, num_kv_heads=1,
        head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, rotary_dim=32, max_position_embeddings=64,
        layer_types=("full_attention",) * layers, mlp_types=("moe",) * layers, attn_qkv_bias=False,
        attn_qk_norm=True, attn_output_gate=False, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, norm_topk_prob=True, shared_expert_intermediate_size=0, intermediate_size=0,
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=0, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(1,))
    layout = RecordLayout.packed(hidden, inter)
    comps = {n: ({"_2": torch.float32}.get(n[-2:], torch.float8_e4m3fn if n.endswith("scale") else torch.uint8),
                 layout.shape(n)) for n in ("gate_up", "gate_up_scale", "gate_up_scale_2", "down", "down_scale",
                                            "down_scale_2")}
    g = torch.Generator().manual_seed(seed)
    w = FtwWriter(out)
    for layer in range(layers):
        w.add_tensor(f"layers.{layer}.mlp.gate.weight", torch.randn(experts, hidden, generator=g).to(torch.bfloat16))
    for layer in range(layers):
        bank = w.add_expert_bank(f"layers.{layer}.mlp.experts", "nvfp4", experts, comps)
        recs = random_records(layout, experts, seed * 100 + layer)
        for e in range(experts):
            bank.write_expert(e, {n: layout.view(recs[e], n).clone() for n in comps})
    return w.finish(config=cfg, quant={"linears": {}, "experts": "nvfp4", "source": None}, tokenizer={},
                    generation={}, provenance={})


def moe_calls(tokens, seed: int, *, experts: int, top_k: int, hidden: int, layers: int = 3):
    """Per call of T tokens (one per entry of `tokens`): (layer, x bf16 [T, hidden], topk_ids [T, top_k] distinct per
    row, topk_weights [T, top_k]); layers cycle 0..layers-1."""
    g = torch.Generator().manual_seed(seed)
    for i, T in enumerate(tokens):
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(T)])
        yield i % layers, x, ids, torch.rand(T, top_k, generator=g)


def still_pinning(ex) -> None:
    """Put a mode-mapped GpuExperts (allocated) in its state before the background pinner has finished: no bank is
    read in place yet, so every call is planned on the host, with the device kernels where `device_plan` is set."""
    import threading
    from types import SimpleNamespace

    ex.pinner = SimpleNamespace(done=threading.Event(), info={}, stop=lambda: None)
