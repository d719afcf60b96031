"""Logits from an FTW: `load_model`, `CausalLM`, `Segment`, `SequenceState`.

Loading walks the FTW: every tensor name is an attribute path of the module tree (no rename table), the tensor is
bound as a zero-copy view of the mmap, and each MoE layer's `mlp.experts` is bound to the experts interface (CPU from
the bank by default). On a device other than the CPU the dense weights are copied there once, except an untied
embedding table, which stays in host memory (only N rows of it are needed per step); expert banks stay where the
experts implementation wants them. The computation dtype is the weights' dtype (that of `embed_tokens.weight`);
logits come back in fp32.

    model = load_model(ftw_dir)
    state = model.new_state(max_tokens=4096)
    [logits] = model.forward(torch.tensor(prompt_ids), [Segment(state, len(prompt_ids))])
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from ft.formats import FtwReader, ModelConfig
from ft.runtime.layers.base import REQUIRED, Op, place, resolve_slot
from ft.runtime.layers.batch import ForwardBatch, SegmentRows, decode_inputs
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.moe import BoundExperts, ExpertsFn
from ft.runtime.layers.norm import RMSNorm
from ft.runtime.layers.rope import Rotary
from ft.runtime.models.base import DecoderLayer, Family, expected_shapes
from ft.runtime.state import Segment, SequenceState

__all__ = ["CausalLM", "Segment", "SequenceState", "load_model"]

FP32_WEIGHTS = ("norm.weight", ".dt_bias", ".A_log", ".e_score_correction_bias", ".k_norm.bias",
                ".weights_proj.weight", ".position_bias", "_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn",
                "hc_head.hc_base", "hc_head.hc_scale")  # name suffixes kept in fp32 (every RMSNorm weight:
# norm.weight; the sigmoid router's correction bias; the DSA indexer's LayerNorm and head weights; deepseek_v4's
# compressors' position biases and hyper-connection weights); integer tables keep their dtype


class Embedding(Op):
    """ids [N] -> rows [N, H] of `weight` [V, H].

    Host-resident table (`keep_on_host`, for a model on a GPU whose LM head is a separate tensor): the table costs no
    VRAM (V x H bf16 is 0.95 GiB for a 248k vocab: a sixth of an 8 GiB card's budget for experts), while a step needs
    only N rows of it. It is copied once into page-locked memory and the GPU gathers the rows itself
    (`gpu.kernels.embedding`), so ids may be on the host or already on the device (sampled there), and the gather
    can be captured in a decode graph. Where page-locking is refused, rows are gathered on the host and copied.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED    # [V, H]
        self._target: torch.device | None = None  # set: weight stays on the host, outputs go to this device
        self._address: int | None = None  # device address of the page-locked table (CUDA)

    def keep_on_host(self, target: torch.device) -> None:
        self._target = target
        if target.type == "cuda":
            from ft.runtime.gpu.kernels.embedding import map_table

            mapped = map_table(self.weight)
            if mapped is not None:
                self.weight, self._address = mapped

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self._target is None:
            return F.embedding(_to_device(ids, self.weight.device), self.weight)
        if self._address is None:
            return F.embedding(ids.cpu(), self.weight).to(self._target)
        from ft.runtime.gpu.kernels.embedding import gather_rows

        out = torch.empty(ids.numel(), self.weight.shape[1], dtype=self.weight.dtype, device=self._target)
        return gather_rows(self._address, _to_device(ids, self._target), out)


class CausalLM(Op):
    """Decoder-only MoE language model; families subclass it and set `family` (their config rules)."""

    family: ClassVar[Family]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.family.check(config)
        self._config = config
        self.embed_tokens = Embedding()
        self.layers = [self.decoder_layer(config, i) for i in range(config.num_layers)]
        self.norm = RMSNorm(config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear()
        self._rotary = Rotary.for_config(config)
        self._dtype = torch.float32
        self._device = torch.device("cpu")
        self.graphs = None  # CUDA: a `DecodeGraphs` (ft.runtime.gpu.graphs) that replays decode steps

    def decoder_layer(self, config: ModelConfig, i: int) -> Op:
        """Layer i of the stack (a family with another residual layout builds its own)."""
        return DecoderLayer(config, i)

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def new_state(self, max_tokens: int, capacity: int | None = None) -> SequenceState:
        """A state for up to `max_tokens` tokens; KV buffers start at `capacity` (default: all) and grow on demand."""
        return SequenceState(self._config, max_tokens, dtype=self._dtype, device=self._device, capacity=capacity)

    def logits_head(self, h: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head of the hidden states h + delta ([N, H] each; delta None: h alone; see
        `layers_pending`) -> fp32 logits [N, V]."""
        _, h = self.norm.add(h, delta)
        if self._config.tie_word_embeddings:
            return F.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
        """input_ids [N] (all segments' tokens concatenated in order) -> per segment logits (see `Segment`).
        Each segment continues its state at `state.length`; the states advance by `num_tokens` on success."""
        decode = all(seg.num_tokens == 1 and seg.logits == "last" for seg in segments)
        if self.graphs is not None and decode:
            self._check(input_ids, segments)
            logits = self.graphs.step(input_ids, [seg.state for seg in segments])  # None: not replayable
            if logits is not None:
                for seg in segments:
                    seg.state.length += 1
                return list(logits.split(1))
        batch = self._plan(input_ids, segments, tables=decode and self._fused)
        h, delta = self.layers_pending(self.embed_tokens(input_ids), batch)
        rows = []
        for seg, sr in zip(segments, batch.segments):
            rows.append(torch.arange(sr.start, sr.start + sr.num_tokens) if seg.logits == "all"
                        else torch.tensor([sr.start + sr.num_tokens - 1]))
        picked = _to_device(torch.cat(rows), self._device)
        logits = self.logits_head(h[picked], None if delta is None else delta[picked]).split([len(r) for r in rows])
        for seg in segments:
            seg.state.length += seg.num_tokens
        return list(logits)

    def layers_pending(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] embeddings -> (h, delta) [N, H] each, whose sum is the last layer's output (before the final norm).
        The last residual add is left pending: `logits_head(h, delta)` does it inside the final norm (one fused
        launch); between layers the pair is handed on the same way (`DecoderLayer`)."""
        if self._rotary is not None:
            batch.rope["cos"], batch.rope["sin"] = self._rotary.cos_sin(batch.positions, self._dtype)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, batch)
        return h, delta

    def _check(self, input_ids: torch.Tensor, segments: list[Segment]) -> list[SegmentRows]:
        """Validate the segments against their states and input_ids -> the rows of each segment."""
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be a 1-D integer tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
        if not segments:
            raise ValueError("forward needs at least one segment")
        rows, start, seen = [], 0, set()
        for i, seg in enumerate(segments):
            st = seg.state
            if not isinstance(st, SequenceState) or st.freed or st.config is not self._config:
                raise ValueError(f"segment {i}: state is not a live SequenceState of this model")
            if id(st) in seen:
                raise ValueError(f"segment {i}: the same state appears twice in one forward")
            seen.add(id(st))
            if seg.num_tokens <= 0 or seg.logits not in ("last", "all"):
                raise ValueError(f"segment {i}: num_tokens must be > 0 and logits 'last' or 'all'")
            if st.length + seg.num_tokens > st.max_tokens:
                raise ValueError(f"segment {i}: {st.length} + {seg.num_tokens} tokens exceed the state's "
                                 f"max_tokens {st.max_tokens}")
            if st.length + seg.num_tokens > st.capacity:
                raise ValueError(f"segment {i}: {st.length} + {seg.num_tokens} tokens exceed the state's KV "
                                 f"capacity {st.capacity}; call state.ensure_capacity first")
            rows.append(SegmentRows(start, seg.num_tokens, st.length, st))
            start += seg.num_tokens
        if start != input_ids.shape[0]:
            raise ValueError(f"segments cover {start} tokens but input_ids has {input_ids.shape[0]}")
        if input_ids.device.type == "cpu":  # ids on an accelerator were sampled there (< V): not read back
            lo, hi = torch.aminmax(input_ids)
            if int(lo) < 0 or int(hi) >= self._config.vocab_size:
                raise ValueError(f"token ids must be in [0, {self._config.vocab_size})")
        return rows

    def _plan(self, input_ids: torch.Tensor, segments: list[Segment], *, tables: bool = False) -> ForwardBatch:
        """Validate the segments -> the batch. `tables`: a decode batch (every segment one token), whose layers find
        the states' buffers through device-side tables (`ForwardBatch.tables`)."""
        rows = self._check(input_ids, segments)
        positions = torch.cat([torch.arange(r.past, r.past + r.num_tokens) for r in rows])
        if tables:  # positions and tables in one host buffer: one copy
            both = torch.cat([positions, torch.stack([seg.state.addresses() for seg in segments], -1).reshape(-1)])
            _, pos, tables = decode_inputs(_to_device(both, self._device), len(segments), self._config.num_layers,
                                           ids=False)
            return ForwardBatch(rows, pos, tables=tables, input_ids=input_ids)
        return ForwardBatch(rows, _to_device(positions, self._device), input_ids=input_ids)

    # -- loading ----------------------------------------------------------------------------------------------
    def bind(self, reader: FtwReader, experts: ExpertsFn) -> None:
        """Attach every FTW tensor and expert bank to its attribute; refuse unknown or missing names."""
        for name in reader.tensor_names():
            try:
                op, attr = resolve_slot(self, name)
            except KeyError:
                raise ValueError(f"{reader.path}: tensor {name!r} is not part of a {self._config.family} "
                                 f"model with this config") from None
            setattr(op, attr, reader.tensor(name))
        for name in reader.bank_names():
            try:
                op, attr = resolve_slot(self, name, bank=True)
            except KeyError:
                raise ValueError(f"{reader.path}: expert bank {name!r} does not belong to an MoE layer") from None
            setattr(op, attr, BoundExperts(experts, int(name.split(".")[1])))
        missing = self.missing()
        if missing:
            raise ValueError(f"{reader.path}: missing tensors for {self._config.family}: {', '.join(missing)}")

    def prepare(self, quant_linears: dict[str, str], device: torch.device, dtype: torch.dtype, *,
                keep_quantized: bool = False) -> None:
        """Dequantize/move linears (quantized ones stay quantized with `keep_quantized`, see layers/linear.py), move
        the other weights (norms and DeltaNet decay params stay fp32), check every shape against the config."""
        linears = {name: op for name, op in self.named_ops() if isinstance(op, Linear)}
        unknown = sorted(set(quant_linears) - set(linears))
        if unknown:
            raise ValueError(f"manifest.quant.linears names modules this model does not have: {unknown}")
        for name, op in linears.items():
            op.prepare(name, quant_linears.get(name), dtype, device, keep_quantized=keep_quantized)
        kept = tuple(f"{name}." for name, op in linears.items() if op.stays_quantized)  # placed as stored
        # an untied embedding table is only gathered from: off the CPU it stays in host memory (see Embedding)
        host = ("embed_tokens.weight",) if device.type != "cpu" and not self._config.tie_word_embeddings else ()
        self.map_weights(lambda n, t: t if n.startswith(kept) else place(
            t, "cpu" if n in host else device,
            t.dtype if not t.is_floating_point() else torch.float32 if n.endswith(FP32_WEIGHTS) else dtype))
        if host:
            self.embed_tokens.keep_on_host(device)
        self._dtype, self._device = dtype, device
        if device.type == "cuda":  # (on the CPU the weights stay zero-copy views of the mmap)
            for _, op in self.named_ops():
                if callable(getattr(op, "stack_linears", None)):
                    op.stack_linears()
        self.set_fused(device.type == "cuda")
        self._check_shapes()

    def set_fused(self, on: bool) -> None:
        """Every op runs its fused kernels (`Op._fused`) or the PyTorch reference ops."""
        for _, op in self.named_ops():
            op._fused = on

    def _check_shapes(self) -> None:
        cfg = self._config
        want = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "norm.weight": (cfg.hidden_size,)}
        if not cfg.tie_word_embeddings:
            want["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        for i in range(cfg.num_layers):
            want |= {f"layers.{i}.{k}": v for k, v in expected_shapes(cfg, i).items()}
        for name, shape in want.items():
            op, attr = resolve_slot(self, name)
            got = op.weight_shape if isinstance(op, Linear) and attr == "weight" else tuple(getattr(op, attr).shape)
            if got != shape:
                raise ValueError(f"tensor {name} has shape {got}, the config implies {shape}")


def load_model(ftw: Path | str | FtwReader, *, device: str = "cpu", experts: ExpertsFn | None = None,
               keep_quantized: bool = False) -> CausalLM:
    """Build the family's model from an FTW (see the module docstring). `experts=None` -> `CpuExperts`;
    `keep_quantized`: quantized dense linears stay quantized on the device (less memory, a dequantization per call)."""
    from ft.runtime.experts import CpuExperts
    from ft.runtime.models import model_class

    reader = ftw if isinstance(ftw, FtwReader) else FtwReader(ftw)
    config = reader.config
    model = model_class(config.family)(config)
    dtype = reader.tensor("embed_tokens.weight").dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{reader.path}: embed_tokens.weight is {dtype}; expected a float compute dtype")
    if experts is None:
        experts = CpuExperts(reader, config, dtype=dtype)
    model.bind(reader, experts)
    model.prepare(dict(reader.quant.get("linears") or {}), torch.device(device), dtype, keep_quantized=keep_quantized)
    return model


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host index tensor on `device`: through pinned memory and non-blocking on CUDA, so the copy does not
    wait for the work already queued (a plain pageable copy would block the host until the GPU catches up)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
