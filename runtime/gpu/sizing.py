"""How much VRAM the engine may use and how it is shared out (the `--vram-budget` / `--memory-ratio` math).

Everything on the device counts against one budget, as `nvidia-smi` shows the process:

    budget = in use at start (what the device holds when the engine starts, measured: the CUDA context; on a
             shared GPU other processes' memory; only with an explicit budget) + LATE_OUTSIDE (kernel modules
             loaded at their first launch, library handles and CUDA graph executables, which appear later outside
             the caching allocator)
           + dense weights (measured after loading; an untied embedding table stays in host memory)
           + KV reserve (kv_reserve_tokens x bytes per token; by default `default_kv_tokens` of what the fixed parts
             leave: room for one agent-sized context, at most KV_MAX_SHARE of that room, the rest to the expert slots)
           + fixed per-sequence state (DeltaNet conv/recurrent state) x max_running_requests
           + two prefill buffers (2 x prefill_slots x record stride) + activation reserve (`activation_reserve`: the
             transients of the widest layer over one prefill chunk, and allocator slack) + expert slots

The expert slots get what is left (never more than every expert of every MoE layer). The caching allocator is then
capped (`cap_allocator`) at what it held at start + budget - outside, so no later allocation can take the process past
the budget: one that would fails as an out-of-memory error instead. Without an explicit budget it is `memory_ratio` x
the VRAM free when the engine starts (what is in use then is already outside it). Host-side pinned buffers are not
VRAM and do not count.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

import torch

from ft.formats import FtwReader, ModelConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int | float) -> int:
    """'8GiB', '12e9', '12 GB', '512MiB', 4096 -> bytes. GB/MB are decimal, GiB/MiB binary."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a byte count; use e.g. 8GiB, 12GB, 12e9 or 512MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"a byte count must be positive, got {text!r}")
    return n


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def state_bytes(config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(KV bytes per token, fixed bytes per sequence) of a SequenceState, measured on the meta device."""
    from ft.runtime.state import SequenceState

    one = SequenceState(config, 1, dtype=dtype, device=torch.device("meta")).nbytes
    two = SequenceState(config, 2, dtype=dtype, device=torch.device("meta")).nbytes
    return two - one, one - (two - one)


# Device memory outside the caching allocator that appears after the engine starts (kernel modules loaded at their
# first launch, cuBLAS handles, CUDA graph executables): counted against the budget on top of what is measured then.
LATE_OUTSIDE = 256 << 20


def device_in_use(device: torch.device) -> int:
    """Bytes of `device` in use now, by anyone (see the module docstring)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def expandable_segments() -> bool:
    """Let the caching allocator grow segments in place (`expandable_segments`), unless PYTORCH_CUDA_ALLOC_CONF /
    PYTORCH_ALLOC_CONF configure it: under the cap, prefill transients of changing sizes otherwise leave free slivers
    in fixed-size segments that no larger request can use (benchmarks/gpu_full.md, run 48: a 226 MiB request refused
    with 431 MiB reserved and free). Segments made before the call stay as they are. True if it was set."""
    if any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return False
    _set_allocator_settings("expandable_segments:True")
    return True


def _set_allocator_settings(text: str) -> None:
    # torch 2.11 deprecates the torch.cuda.memory spelling in favour of the accelerator-generic one (both private)
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (set_settings or torch.cuda.memory._set_allocator_settings)(text)


def cap_allocator(device: torch.device, limit: int | None) -> None:
    """Cap this process's caching allocator on `device` at `limit` bytes reserved (None: lift the cap)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if limit is None else min(1.0, limit / total), device)


PREFILL_CHUNK = 2048  # prompt tokens per forward (--max-prefill-length) ...
OFFLOADED_PREFILL_CHUNK = 4096  # ... at a VRAM budget: a forward streams every expert without a slot whatever its size

# last-token logits and library workspaces (~96 MiB), and what the caching allocator keeps reserved beyond what is
# allocated at the prefill peak, which the cap counts: 170 MiB (qwen3moe-35b-geom) and 119 MiB (gpt-oss-20b, where a
# 114 MiB request then failed 10 MiB short of the cap) at 8 GiB budgets (benchmarks/gpu_full.md, runs 63 and 61)
RESERVE_SLACK = 256 << 20
RESERVE_MARGIN = 1.1  # on the estimate below, which counts only the largest temporaries


def activation_reserve(cfg: ModelConfig, chunk: int, elem: int) -> int:
    """Bytes a prefill forward of `chunk` tokens allocates beyond its weights, KV and state (the activation reserve of
    the VRAM split), from the model's widths; `elem`: bytes per compute-dtype element. Per token: the residual stream
    (h, residual, normed input, mixer output) plus the widest layer's temporaries: the routed experts' per-pair fp32
    outputs and activations (`prefill_pipeline._Runs`, its rows padded per expert) with the router and shared expert,
    attention's projections and chunked-prefill temporaries, a DeltaNet layer's projections plus its fp32 conv / rule
    temporaries, which it bounds to `deltanet.PIECE` tokens."""
    from ft.runtime.layers.deltanet import PIECE

    h, k = cfg.hidden_size, cfg.num_experts_per_tok
    stream = 4 * h * elem
    moe = k * (4 * h + elem * cfg.moe_intermediate_size) + (4 + elem) * h + 8 * cfg.num_experts \
        + 3 * elem * cfg.shared_expert_intermediate_size
    dense = 3 * elem * cfg.intermediate_size if "dense" in cfg.mlp_types else 0
    # projections and their normed / rotated copies; a chunk after the first (`attention._flash_split`) adds six
    # [T, nq, hd] tensors: folded queries, both parts' outputs (one unfolded), expanded own keys and values
    width = max(cfg.head_dim, cfg.v_head_dim)
    attn = elem * (3 * (cfg.num_heads + 2 * cfg.num_kv_heads) + 6 * cfg.num_heads) * width
    # the MoE activation buffer's rows are padded to whole BLOCK_M (<= 128) blocks per expert (`moe_blocks`)
    moe_padding = cfg.num_experts * 127 * elem * cfg.moe_intermediate_size
    widest = max(chunk * moe + moe_padding, chunk * max(dense, attn))
    if "linear_attention" in cfg.layer_types:
        key, value, hv = (cfg.linear_num_key_heads * cfg.linear_key_head_dim,
                          cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads)
        per_piece_token = 20 * (2 * key + value) + 16 * value  # conv window/output/fp32 copies; q, k, v, u, w, o
        widest = max(widest, chunk * elem * (2 * key + 3 * value + 2 * hv) + min(chunk, PIECE) * per_piece_token)
    return int(RESERVE_MARGIN * (chunk * stream + widest)) + RESERVE_SLACK


def resolve_reserve(given: int | None, reader: FtwReader, chunk: int | None, *, dense_quantized: bool = False) -> int:
    """The activation reserve: `given` (OffloadConfig.reserve_bytes), else `activation_reserve` for prefill chunks of
    `chunk` tokens (None: the engine's default at a budget, OFFLOADED_PREFILL_CHUNK) in the FTW's compute dtype, plus,
    with dense linears kept quantized, what a prefill projection's dequantization holds (`dequant_transient`)."""
    if given is not None:
        return given
    elem = reader.tensor("embed_tokens.weight").element_size()
    dequant = dequant_transient(reader) if dense_quantized else 0
    return activation_reserve(reader.config, chunk or OFFLOADED_PREFILL_CHUNK, elem) + dequant


def dequant_transient(reader: FtwReader) -> int:
    """What a kept-quantized linear's call past the GEMV holds while it dequantizes (`linear.dequant_chunks`): at most
    `linear.DEQUANT_TRANSIENT`, less where the largest quantized weight is smaller (20 bytes a weight: the PyTorch
    fallback's fp32 values, codes and copies)."""
    from ft.runtime.layers.linear import DEQUANT_TRANSIENT

    largest = 0
    for name, scheme in (reader.quant.get("linears") or {}).items():
        out, k = reader.tensor(f"{name}.weight").shape
        largest = max(largest, out * k * (2 if scheme == "nvfp4" else 1))
    return min(DEQUANT_TRANSIENT, 20 * largest)


KV_TARGET_TOKENS = 65536  # default KV budget: room for one coding agent's long conversation
KV_MIN_TOKENS = 8192
KV_MAX_SHARE = 0.55  # of the room the fixed parts leave (the rest is the expert cache's): qwen3.6 at 8 GiB fits 64k


def default_kv_tokens(room: int, per_token: int, max_context: int, block: int = 256) -> int:
    """The KV budget when none is given: KV_TARGET_TOKENS (never past the model's context), cut to KV_MAX_SHARE of
    `room` (the bytes the fixed parts leave for KV + expert slots) but never below KV_MIN_TOKENS (the former fixed
    default: a budget too small for it is refused by `plan_vram` as before); a multiple of `block`."""
    want = min(KV_TARGET_TOKENS, max_context)
    fits = int(KV_MAX_SHARE * max(room, 0)) // max(per_token, 1)
    tokens = min(want, max(KV_MIN_TOKENS, fits))
    return max(block, tokens // block * block)


@dataclass(frozen=True)
class VramPlan:
    budget: int
    outside: int  # in use at start + LATE_OUTSIDE (module docstring; 0 off CUDA)
    dense: int  # weights already on the GPU
    kv: int  # KV reserve + per-sequence fixed state
    prefill_buffers: int
    reserve: int  # activations, logits, allocator slack
    num_slots: int
    slot_bytes: int
    max_slots: int
    dense_quantized: bool = False  # quantized dense linears kept as stored (OffloadConfig.dense)
    kv_tokens: int = 0  # the KV budget in tokens (the engine's, whether given or sized here)

    @property
    def cached_fraction(self) -> float:
        return self.num_slots / self.max_slots if self.max_slots else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "cached_fraction": self.cached_fraction}


def left_after(budget: int, *, dense: int, kv: int, stride: int, prefill_slots: int, reserve: int,
               outside: int = 0) -> int:
    """Bytes of `budget` the fixed parts leave (negative: they do not fit): what the expert slots get, and with
    `kv` only the per-sequence state, what KV and the slots share (`default_kv_tokens`'s room)."""
    return budget - outside - dense - kv - 2 * prefill_slots * stride - reserve


def plan_vram(budget: int, *, dense: int, kv: int, stride: int, prefill_slots: int, reserve: int,
              max_slots: int, dense_quantized: bool = False, outside: int = 0, kv_tokens: int = 0) -> VramPlan:
    """Slots that fit after the fixed parts; refuses a budget that cannot even hold the fixed parts."""
    prefill = 2 * prefill_slots * stride
    free = left_after(budget, dense=dense, kv=kv, stride=stride, prefill_slots=prefill_slots, reserve=reserve,
                      outside=outside)
    if free < 0:
        raise ValueError(
            f"the VRAM budget {fmt_bytes(budget)} is smaller than the fixed allocations: in use at start with kernel "
            f"modules (CUDA context, other processes) {fmt_bytes(outside)} + dense weights {fmt_bytes(dense)} + KV "
            f"{fmt_bytes(kv)} + prefill buffers {fmt_bytes(prefill)} + reserve {fmt_bytes(reserve)}; raise "
            f"--vram-budget / --memory-ratio or lower --kv-reserve-tokens")
    n = int(min(max_slots, free // stride))
    return VramPlan(budget, outside, dense, kv, prefill, reserve, n, n * stride, max_slots, dense_quantized,
                    kv_tokens)


def split_budget(budget: int, *, dense: int, per_token: int, per_seq: int, max_running_requests: int,
                 kv_tokens: int | None, max_context: int, stride: int, prefill_slots: int, reserve: int,
                 max_slots: int, dense_quantized: bool = False, outside: int = 0) -> VramPlan:
    """The whole split of `budget` (the engine's at start, `ft plan`'s ahead of it): the KV budget (`kv_tokens`, else
    `default_kv_tokens` of what the fixed parts leave), then `plan_vram`."""
    if kv_tokens is None:
        room = left_after(budget, dense=dense, kv=max_running_requests * per_seq, stride=stride,
                          prefill_slots=prefill_slots, reserve=reserve, outside=outside)
        kv_tokens = default_kv_tokens(room, per_token, max_context)
    kv = kv_tokens * per_token + max_running_requests * per_seq
    return plan_vram(budget, dense=dense, kv=kv, stride=stride, prefill_slots=prefill_slots, reserve=reserve,
                     max_slots=max_slots, dense_quantized=dense_quantized, outside=outside, kv_tokens=kv_tokens)


def resolve_budget(device: torch.device, vram_budget: int | None, memory_ratio: float) -> int:
    """The explicit budget, else memory_ratio x free VRAM now (call before loading anything)."""
    if not 0 < memory_ratio <= 1:
        raise ValueError(f"memory_ratio must be in (0, 1], got {memory_ratio}")
    if vram_budget is not None:
        if vram_budget <= 0:
            raise ValueError(f"vram_budget must be positive, got {vram_budget}")
        return int(vram_budget)
    if device.type != "cuda":
        raise ValueError("without a CUDA device the VRAM budget must be given explicitly (vram_budget)")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * memory_ratio)


def dense_weight_bytes(reader: FtwReader, *, keep_quantized: bool) -> tuple[int, dict[int, int]]:
    """(bytes outside the layers, bytes per layer index) that the dense weights take on a GPU, as `CausalLM.prepare`
    places them: the compute dtype (that of embed_tokens), fp32 for norms and DeltaNet decay parameters; quantized
    linears dequantized, or as stored with `keep_quantized`; an untied embedding table stays on the host. Computed
    from the FTW's tensor records (for choices made before loading, and for benchmarks that scale a model)."""
    from ft.runtime.model import FP32_WEIGHTS

    quant = reader.quant.get("linears") or {}
    elem = reader.tensor("embed_tokens.weight").element_size()
    nonlayer, per_layer = 0, {}
    for name in reader.tensor_names():
        base, leaf = name.rsplit(".", 1)
        t = reader.tensor(name)
        if name == "embed_tokens.weight" and not reader.config.tie_word_embeddings:
            size = 0
        elif base in quant and leaf != "bias":
            if keep_quantized:
                size = t.nbytes
            else:  # scales fold into the dequantized weight; an NVFP4 byte holds two weights
                size = t.numel() * (2 if quant[base] == "nvfp4" else 1) * elem if leaf == "weight" else 0
        else:
            size = t.numel() * (4 if name.endswith(FP32_WEIGHTS) else elem)
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            per_layer[i] = per_layer.get(i, 0) + size
        else:
            nonlayer += size
    return nonlayer, per_layer


def resolve_dense(reader: FtwReader, choice: str, budget: int | None, max_batch: int) -> str:
    """`--dense-weights` as the engine applies it, for decode batches of at most `max_batch` sequences. "auto" keeps
    an FTW's quantized dense linears as stored
    * when every decode call fits the dequantizing GEMV (`max_batch` <= linear.GEMV_MAX_TOKENS): it reads the stored
      bytes once, 2-4x fewer than the bf16 copy, and a prefill chunk dequantizes each weight in one launch
      (`kernels/dense_dequant.py`, a few % of the chunk); the stored form also leaves more of a budget to experts;
    * else whenever the budget cannot hold the model with them dequantized (dense weights plus every expert record),
      as then every byte they save (2-4x) becomes expert slots: bigger batches dequantize per call, the bf16 copy
      would not.
    "dequantized" and "quantized" pass through. Measured: `benchmarks/gpu_full.md` (runs 94 and 97)."""
    from ft.runtime.layers.linear import GEMV_MAX_TOKENS

    if choice != "auto":
        return choice
    if not reader.quant.get("linears"):
        return "dequantized"
    if max_batch <= GEMV_MAX_TOKENS:
        return "quantized"
    if budget is None:
        return "dequantized"
    nonlayer, per_layer = dense_weight_bytes(reader, keep_quantized=False)
    experts = sum(b.num_experts * b.stride for b in map(reader.bank, reader.bank_names()))
    return "quantized" if nonlayer + sum(per_layer.values()) + experts > budget else "dequantized"
