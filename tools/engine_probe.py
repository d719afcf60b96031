"""Wrappers that time and count what `Engine.step` does around `model.forward`, without editing the runtime.

    probe = Probe(vocab_size)
    with instrument(engine, probe), HostReads(probe), VocabOps(probe):
        probe.reset(); engine.step()
    probe.times  # seconds per phase of this step: forward, sample, accept, prepare, schedule
    probe.reads  # tensor reads to the host outside model.forward (tolist/item/int/bool/float: a device sync each)
    probe.big_ops  # non-view ops outside model.forward producing >= vocab elements (a full-vocab pass each)
    engine_round(engine, prompts, params, count=False)  # the same, per decode-only step of B requests run to the end

Used by tools/bench_engine_overhead.py. The wrapped names
are looked up at run time; a piece this engine version lacks is simply not timed.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "sample", "accept", "prepare", "schedule")
HOST_READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "numpy"}


class Probe:
    """Per-step phase times, plus (when counting) host reads and vocab-sized ops outside model.forward."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.in_forward = vocab, 0
        self.reset()

    def reset(self) -> None:
        self.times = dict.fromkeys(PHASES, 0.0)
        self.reads = self.big_ops = self.tokens = 0  # tokens: in this step's forward


def engine_pieces(engine) -> list[tuple[object, str, str]]:
    """(owner, attribute, phase) of each piece of `Engine.step` worth timing; owners are the model, the engine
    module (its `sample`), the Request class and the engine instance."""
    import ft.runtime.engine as engine_mod
    from ft.runtime.request import Request

    return [(engine.model, "forward", "forward"), (engine_mod, "sample", "sample"), (Request, "accept", "accept"),
            (engine, "_prepare_inputs", "prepare"), (engine, "_schedule", "schedule"), (engine, "_admit", "schedule")]


@contextlib.contextmanager
def instrument(engine, probe: Probe):
    """Wrap the engine's pieces (module/class/instance attributes, restored on exit) to time them into `probe`."""
    patches = []

    def wrap(owner, name: str, phase: str):
        fn = getattr(owner, name, None)
        if fn is None:
            return  # this engine version has no such piece

        def timed(*a, **kw):
            fwd = phase == "forward"
            if fwd:
                probe.tokens, probe.in_forward = int(a[0].numel()), probe.in_forward + 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                probe.times[phase] += time.perf_counter() - t
                probe.in_forward -= fwd

        patches.append((owner, name, name in vars(owner), vars(owner).get(name)))
        setattr(owner, name, timed)

    for owner, name, phase in engine_pieces(engine):
        wrap(owner, name, phase)
    try:
        yield probe
    finally:
        for owner, name, own, original in reversed(patches):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # an instance attribute: the class's method shows through again


class HostReads(TorchFunctionMode):
    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.probe.in_forward and getattr(func, "__name__", "") in HOST_READS:
            self.probe.reads += 1
        return func(*args, **(kwargs or {}))


class VocabOps(TorchDispatchMode):
    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not self.probe.in_forward and not func.is_view and any(
                isinstance(o, torch.Tensor) and o.numel() >= self.probe.vocab for o in outs):
            self.probe.big_ops += 1  # views (slices of the logits) are free
        return out


def engine_round(engine, prompts: list[list[int]], params, *, count: bool = False) -> list[dict]:
    """Run B requests to completion; one record per decode-only step (every request past its prompt)."""
    probe = Probe(engine.config.vocab_size)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.perf_counter_ns()}", p, params)
    steps = []
    with instrument(engine, probe), (HostReads(probe) if count else contextlib.nullcontext()), \
            (VocabOps(probe) if count else contextlib.nullcontext()):
        while engine.has_unfinished():
            probe.reset()
            t = time.perf_counter()
            events = engine.step()
            total = time.perf_counter() - t
            if probe.tokens and probe.tokens == len([e for e in events if e.token_id is not None]) == len(prompts):
                rec = {k: v * 1e3 for k, v in probe.times.items()}
                rec["step"] = total * 1e3
                rec["other"] = rec["step"] - sum(probe.times.values()) * 1e3
                rec["reads"], rec["big_ops"] = probe.reads, probe.big_ops
                steps.append(rec)
    return steps
