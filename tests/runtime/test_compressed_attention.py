"""deepseek_v4's attention layers (sliding, CSA, HCA) and hyper-connections against transformers' own modules at fp32.

A toy DeepseekV4 model (transformers, random weights, the parameters transformers initialises to zeros or ones
drawn at random too) runs a prompt through its cache in chunks, then decodes; forward hooks record what each
attention module received and returned. Our layer, given the same weights and inputs, must return the same outputs
with its own state, whatever the chunking (window ends inside and across chunks, CSA's window overlap across calls,
the indexer's top-k smaller than the complete entries).
"""

from __future__ import annotations

import pytest
import torch

from ft.runtime.layers.base import resolve_slot
from ft.runtime.layers.compressed_attention import CompressedAttention, CompressedAttentionSpec, rope_interleaved
from ft.runtime.layers.hyper import HyperConnection, HyperHead
from ft.runtime.layers.rope import Rotary

transformers = pytest.importorskip("transformers")

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
TOL = 1e-5


def _config():
    return transformers.DeepseekV4Config(
        vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, q_lora_rank=16, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=KINDS, mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates=dict(RATES), hc_mult=3,
        sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2,
        rope_theta=10_000.0, compress_rope_theta=160_000.0)


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():   # O(1) activations; no parameter left at its 0 / 1 init
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.5)
        tid2eid = model.model.layers[0].mlp.gate.tid2eid
        tid2eid.copy_(torch.randint(0, 4, tid2eid.shape))
    return model


def _spec(cfg, i: int) -> CompressedAttentionSpec:
    kind = cfg.layer_types[i]
    csa = kind == "compressed_sparse_attention"
    return CompressedAttentionSpec(
        kind=kind, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        rotary_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window, rms_norm_eps=cfg.rms_norm_eps,
        compress_rate=cfg.compress_rates.get(kind, 0), index_n_heads=cfg.index_n_heads if csa else 0,
        index_head_dim=cfg.index_head_dim if csa else 0, index_topk=cfg.index_topk if csa else 0)


def _ours(hf, i: int) -> CompressedAttention:
    cfg = hf.config
    theta = cfg.rope_theta if cfg.layer_types[i] == "sliding_attention" else cfg.compress_rope_theta
    op = CompressedAttention(_spec(cfg, i), Rotary(cfg.qk_rope_head_dim, theta))
    for name, t in hf.model.layers[i].self_attn.state_dict().items():
        owner, attr = resolve_slot(op, name.replace("scorer.", ""))
        setattr(owner, attr, t.detach().clone())
    assert not op.missing()
    return op


def _record(hf, ids: torch.Tensor, chunks: list[int]) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Feed ids through transformers' cache in chunks, then one token at a time -> per layer (input, output) of
    each attention call."""
    seen: dict[int, list] = {i: [] for i in range(len(hf.model.layers))}
    hooks = [layer.self_attn.register_forward_hook(
        lambda mod, args, out, i=i: seen[i].append((args[0][0].clone(), out[0][0].clone())))
        for i, layer in enumerate(hf.model.layers)]
    cache, pos = transformers.DynamicCache(config=hf.config), 0
    try:
        with torch.no_grad():
            for n in chunks:
                hf(ids[None, pos:pos + n], cache=cache, use_cache=True)
                pos += n
    finally:
        for h in hooks:
            h.remove()
    assert pos == len(ids)
    return seen


@pytest.mark.parametrize("chunks", [[27, 1, 1, 1, 1, 1], [5, 3, 9, 10, 1, 1, 1, 1, 1], [1] * 20])
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_attention_matches_transformers(hf, layer, chunks):
    ids = torch.randint(0, 96, (sum(chunks),), generator=torch.Generator().manual_seed(1))
    calls = _record(hf, ids, chunks)[layer]
    op = _ours(hf, layer)
    state, past, worst, size = op.new_state(64, torch.float32), 0, 0.0, 0.0
    for x, want in calls:
        got = op(x, past, state)
        worst, size = max(worst, (got - want).abs().max().item()), max(size, want.abs().max().item())
        past += x.shape[0]
    print(f"\nlayer {layer} ({hf.config.layer_types[layer]}), chunks {chunks}: max |d| = {worst:.1e} "
          f"(max |out| {size:.2f})")
    assert worst < TOL and size > 0.3


def test_compressed_entries_and_selection_matter(hf):
    """The compressed entries change the outputs (they are attended), and CSA's top-k is a real choice: with it
    lifted, late queries leave transformers'."""
    ids = torch.randint(0, 96, (32,), generator=torch.Generator().manual_seed(2))
    for layer in (1, 2):
        [(x, want)] = _record(hf, ids, [32])[layer]
        op = _ours(hf, layer)
        del op.compressor
        assert (op(x, 0, op.new_state(32, torch.float32)) - want)[-1].abs().max() > 1e-2
    [(x, want)] = _record(hf, ids, [32])[1]
    op = _ours(hf, 1)
    op.compressor.indexer._topk = 100
    assert (op(x, 0, op.new_state(32, torch.float32)) - want)[-1].abs().max() > 1e-2


def test_state_capacity_and_spec_refusals():
    spec = _spec(_config(), 2)
    op = CompressedAttention(spec, Rotary(spec.rotary_dim, 10_000.0))
    with pytest.raises(ValueError, match="capacity"):
        op(torch.zeros(9, 32), 0, op.new_state(8, torch.float32))
    with pytest.raises(ValueError, match="rope of 8 dims"):
        CompressedAttention(spec, Rotary(8, 10_000.0))
    base = dict(hidden_size=32, num_heads=4, head_dim=16, rotary_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8,
                sliding_window=6, rms_norm_eps=1e-6)
    for bad, match in ((dict(kind="full_attention"), "not in"),
                       (dict(kind="sliding_attention", compress_rate=4), "compress_rate 0"),
                       (dict(kind="heavily_compressed_attention"), "compress_rate > 0"),
                       (dict(kind="compressed_sparse_attention", compress_rate=4), "index_"),
                       (dict(kind="heavily_compressed_attention", compress_rate=8, index_topk=2), "index_"),
                       (dict(kind="sliding_attention", o_groups=3), "o_groups")):
        with pytest.raises(ValueError, match=match):
            CompressedAttentionSpec(**(base | bad))


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(3))
    ang = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    want = apply_rotary_pos_emb(x.transpose(0, 1)[None], ang.cos()[None], ang.sin()[None])[0].transpose(0, 1)
    assert torch.allclose(rope_interleaved(x, ang.cos(), ang.sin()), want, atol=1e-6)
    assert torch.allclose(rope_interleaved(rope_interleaved(x, ang.cos(), ang.sin()), ang.cos(), -ang.sin()), x,
                          atol=1e-5)


def test_hyper_connections_match_transformers(hf):
    cfg, layer = hf.config, hf.model.layers[1]
    streams = torch.randn(7, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    block_out = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    ours = HyperConnection(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    for name, t in layer.attn_hc.state_dict().items():
        setattr(ours, name, t.detach().clone())
    with torch.no_grad():
        post, comb, collapsed = layer.attn_hc(streams[None])
        want = post.unsqueeze(-1) * block_out[None].unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams[None])
    p, c, x = ours.weights(streams)
    assert torch.allclose(x, collapsed[0], atol=1e-6) and torch.allclose(c, comb[0], atol=1e-6)
    assert torch.allclose(HyperConnection.expand(streams, block_out, p, c), want[0], atol=1e-5)
    assert torch.allclose(c.sum(-1), torch.ones(7, cfg.hc_mult), atol=1e-3)   # Sinkhorn: ~doubly stochastic
    head = HyperHead(cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    for name, t in hf.model.hc_head.state_dict().items():
        setattr(head, name, t.detach().clone())
    with torch.no_grad():
        assert torch.allclose(head(streams), hf.model.hc_head(streams[None])[0], atol=1e-6)
    with pytest.raises(ValueError, match="hc_mult"):
        HyperConnection(0, 20, 1e-6, 1e-6)


def test_sqrtsoftplus_and_hash_routing_match_transformers(hf):
    from ft.runtime.layers.moe import route_sqrtsoftplus

    cfg = hf.config
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(8))
    for i in (0, 1):                              # layer 0 hash-routed, layer 1 top-k with the correction bias
        gate = hf.model.layers[i].mlp.gate
        with torch.no_grad():
            if i == 1:
                gate.e_score_correction_bias.copy_(torch.randn(4) * 0.5)
                _, want_w, want_ids = gate(x)
                got_ids, got_w = route_sqrtsoftplus(_linear(x, gate.weight), gate.e_score_correction_bias,
                                                    cfg.num_experts_per_tok, cfg.routed_scaling_factor)
            else:
                _, want_w, want_ids = gate(x, ids)
                got_ids, got_w = route_sqrtsoftplus(_linear(x, gate.weight), None, cfg.num_experts_per_tok,
                                                    cfg.routed_scaling_factor, hashed=gate.tid2eid[ids])
        order, want_order = got_ids.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(got_ids.gather(1, order), want_ids.gather(1, want_order))
        assert torch.allclose(got_w.gather(1, order), want_w.gather(1, want_order), atol=1e-6)
    unbiased = route_sqrtsoftplus(_linear(x, gate.weight), None, 2, 1.5)[0]       # the bias changes the choice
    assert not torch.equal(got_ids.sort(-1)[0], unbiased.sort(-1)[0])


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.detach())
