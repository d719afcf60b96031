"""`ft checkpoint`: compile a Hugging Face MoE checkpoint (local dir or hub repo id) into an FTW directory.

Pipeline: locate → index headers → family config → quant declaration → plan → check the whole plan against the
headers (nothing is written before this passes) → stream tensors into the FtwWriter (temp dir) → check what was
written, then rename the temp dir into place (a failed check leaves nothing at the output path).

`--quantize nvfp4` quantizes the routed experts of an unquantized (or block-FP8, from its dequantized values) source
per expert while streaming (`ft.compiler.quant.nvfp4`, specs/families.md "Quantizing at compile time"); the rest of
the pipeline is unchanged.

The final check (`verify`): "sample" (default) opens the result with every structural rule of `ft verify` (V1-V19)
and re-reads from disk the first and last region of each data file, the first and last record of each expert bank
and random others up to 256 MiB, plus every side file (V20, V21 there); "full" re-reads every byte, like `ft
verify`. Every digest was computed by the writer from the bytes it wrote, so the full re-read only guards against
the disk; on a 21 GB output it would add ~50% to the compile's I/O (benchmarks/compile.md). Run `ft verify` for it.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch

from ft.compiler.async_writer import AsyncWriter
from ft.compiler.emit import Emitter
from ft.compiler.errors import CheckpointError, supported
from ft.compiler.expert_jobs import default_threads
from ft.compiler.families import family_for
from ft.compiler.linear import DtypePolicy
from ft.compiler.metadata import (Hasher, free_bytes, generation_defaults, provenance, published_sha256,
                                  source_files, tokenizer_assets)
from ft.compiler.prepare import prepare
from ft.compiler.progress import byte_progress
from ft.compiler.quant.modelopt import parse_quant
from ft.compiler.safetensors_io import TensorReader
from ft.compiler.source import Checkpoint, locate, read_json_if_exists
from ft.compiler.source_stream import SourceStream
from ft.formats import FtwError, FtwReader, FtwWriter
from ft.formats.verify import check, full_plan, plan_bytes, sample_plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VERIFY_MODES = ("sample", "full")
QUANTIZE = ("nvfp4",)  # --quantize: schemes the routed experts of an unquantized/block-FP8 source can be quantized to
QUANTIZE_DENSE = ("fp8", "nvfp4")  # --quantize-dense: the same for its plain dense linears (`linear.dense_quantizable`)
_CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_policy(dtype: str, dequant: bool, hf: dict, quantize: str | None = None,
                 quantize_dense: str | None = None) -> DtypePolicy:
    """--dtype / --dequant -> DtypePolicy; `plain` (for dequantized weights) is --dtype, else the config's declared
    dtype (`torch_dtype` in older configs, `dtype` in newer ones, possibly inside text_config), else bf16."""
    if dtype != "auto" and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not supported; supported: auto, {supported(DTYPES)}")
    explicit = DTYPES.get(dtype)
    declared = hf.get("torch_dtype") or hf.get("dtype") or (hf.get("text_config") or {}).get("dtype") \
        or (hf.get("text_config") or {}).get("torch_dtype")
    plain = explicit or _CONFIG_DTYPES.get(declared, torch.bfloat16)
    if quantize is not None and quantize not in QUANTIZE:
        raise CheckpointError(f"--quantize {quantize!r} is not supported; supported: {', '.join(QUANTIZE)}")
    if quantize_dense is not None and quantize_dense not in QUANTIZE_DENSE:
        raise CheckpointError(f"--quantize-dense {quantize_dense!r} is not supported; supported: "
                              f"{', '.join(QUANTIZE_DENSE)}")
    if (quantize or quantize_dense) and dequant:
        raise CheckpointError(f"--{'quantize' if quantize else 'quantize-dense'} and --dequant contradict each other; "
                              "pass one of them")
    return DtypePolicy(explicit, plain, dequant, quantize, quantize_dense)


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _check_out(out_dir: Path, root: Path, force: bool) -> None:
    out, src = out_dir.resolve(), root.resolve()
    if out == src or out in src.parents:
        raise CheckpointError(f"--out {out_dir} would replace the input checkpoint; choose another directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise CheckpointError(f"--out {out_dir} exists and is not empty; pass --force to replace it")


def compile_checkpoint(model: str | Path, out_dir: str | Path, *, revision: str | None = None, dtype: str = "auto",
                       dequant: bool = False, force: bool = False, progress: bool = True,
                       verify: str = "sample", quantize: str | None = None, threads: int | None = None,
                       quantize_dense: str | None = None) -> Path:
    """Compile `model` (a directory or a hub repo id) into the FTW directory `out_dir`; returns `out_dir`.
    `verify`: the final check, "sample" or "full" (module doc). Raises CheckpointError with a one-line reason for
    any bad or unsupported input, and for a failed final check (then nothing is left at `out_dir`).
    `quantize` ("nvfp4"): quantize the routed experts of an unquantized or block-FP8 source to NVFP4 (ModelOpt's
    recipe, `ft.compiler.quant.nvfp4`); dense linears, routers and embeddings keep their dtype (block-FP8 dense
    linears are dequantized, as without `quantize`). `quantize_dense` ("fp8": one scale per row, or "nvfp4"): the
    plain attention / DeltaNet / dense-MLP / shared-expert projections and the LM head too (`linear.DENSE_QUANTIZABLE`),
    which the GPU runtime keeps quantized at small budgets. `threads`: workers quantizing experts in parallel with the
    reading and writing (default: all cores; `ft.compiler.expert_jobs`); the output does not depend on it."""
    if verify not in VERIFY_MODES:
        raise CheckpointError(f"--verify {verify!r} is not supported; supported: {', '.join(VERIFY_MODES)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise CheckpointError(f"--threads {threads!r}: a positive number of threads is needed")
    # The work is streaming copies of at most a few MB per op: torch's intra-op thread pool only adds barrier
    # latency (tens of ms per op on a busy machine), so run single-threaded and restore the caller's setting.
    # --quantize spreads whole experts over `threads` workers instead (expert_jobs.py).
    caller = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compile(model, Path(out_dir), revision, dtype, dequant, force, progress, verify, quantize,
                        quantize_dense, threads or default_threads())
    finally:
        torch.set_num_threads(caller)


def _compile(model: str | Path, out_dir: Path, revision: str | None, dtype: str, dequant: bool, force: bool,
             progress: bool, verify: str, quantize: str | None, quantize_dense: str | None, threads: int) -> Path:
    loc = locate(str(model), revision)
    _check_out(out_dir, loc.root, force)
    # sha256 of every source file: the small metadata files on a background thread, the weight files by the
    # stream that also serves the compile's tensor reads (each weight byte is read from disk once), or, where the
    # download recorded it, the sha256 the hub publishes for the file (`published_sha256`). The stream
    # starts as soon as the weight files are known, on the embedding's file (every plan starts with the
    # embedding), so that the disk works while headers are parsed and the plan is built.
    hasher = Hasher(loc.root, source_files(loc.root, []))
    streams: list[SourceStream] = []

    def start(config: dict, files: list[str], wmap: dict | None) -> None:
        streams.append(SourceStream(loc.root, files, published={
            n: d for n in files if (d := published_sha256(loc.root, n)) is not None}))
        # a guess before the family binds its prefix (a wrong one costs speed only, see SourceStream)
        embed = sorted(n for n in wmap or {} if n.startswith("model.") and n.endswith("embed_tokens.weight"))
        streams[0].prefetch(wmap[embed[0]] if embed else files[0])

    hasher.start()
    try:
        ck = Checkpoint.open(loc.root, on_files=start)
        return _emit(loc, ck, out_dir, hasher, streams[0], dtype, dequant, force, progress, verify, quantize,
                     quantize_dense, threads)
    finally:
        for s in streams:
            s.stop()
        hasher.stop()


def _emit(loc, ck: Checkpoint, out_dir: Path, hasher: Hasher, stream: SourceStream, dtype: str, dequant: bool,
          force: bool, progress: bool, verify: str, quantize: str | None, quantize_dense: str | None,
          threads: int) -> Path:
    family = family_for(ck.config)
    gen = read_json_if_exists(loc.root, "generation_config.json")
    cfg = family.normalize(ck.config, gen)
    family.bind(ck)
    reader = TensorReader()
    try:
        cfg, tied_skip = family.resolve_tie(cfg, ck, reader.read)
    finally:
        reader.close()
    decl = parse_quant(ck.config, read_json_if_exists(loc.root, "hf_quant_config.json"))
    pol = dtype_policy(dtype, dequant, ck.config, quantize, quantize_dense)
    if quantize and decl.quantized and decl.default != "fp8_block":
        raise CheckpointError(f"--quantize {quantize}: {loc.root.name} is already quantized "
                              f"({_quant_name(decl.source)}); --quantize takes an unquantized BF16/FP16/FP32 source "
                              "or a block-FP8 one")
    prep = prepare(family.plan(cfg, ck), ck, decl, pol, family.skip_prefixes + tied_skip)
    if quantize and prep.bank_scheme != quantize:
        raise CheckpointError(f"--quantize {quantize}: {loc.root.name} has no routed experts to quantize")
    tok_meta, assets = tokenizer_assets(loc.root)
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    need = prep.out_bytes + sum(len(a) for a in assets.values())
    if free_bytes(parent) < need:
        raise CheckpointError(f"not enough free space for {out_dir}: up to {_size(need)} needed, "
                              f"{_size(free_bytes(parent))} free")

    w = FtwWriter(out_dir, force=force)
    aw = AsyncWriter(w)
    try:
        with byte_progress(progress, "compile", prep.read_bytes) as advance:
            em = Emitter(ck, aw, pol, advance, stream, threads)
            em.run(prep)
            aw.drain()
        for name, data in assets.items():
            w.add_asset(name, data)
        quant = {"linears": dict(sorted(em.linears.items())), "experts": prep.bank_scheme,
                 "source": decl.source}
        metadata = {"architectures": ck.config.get("architectures") or [], "model_type": ck.config.get("model_type"),
                    "skipped": prep.skipped, "ignored": prep.ignored,
                    "options": {"dtype": dtype, "dequant": dequant, "quantize": quantize,
                                "quantize_dense": quantize_dense}}
        if quantize or quantize_dense:  # provenance of the codes: this compiler, not the source (specs/ftw.md §5.9)
            metadata["quantized"] = {"by": "ft checkpoint --quantize", "recipe": "modelopt",
                                     **({"experts": quantize} if quantize else {}),
                                     **({"dense": quantize_dense} if quantize_dense else {})}
        w.finish(config=cfg, quant=quant, tokenizer=tok_meta, generation=generation_defaults(gen, cfg),
                 provenance=provenance(loc.source, loc.revision, _digests(hasher, stream)), metadata=metadata,
                 check=lambda tmp: _verify(tmp, out_dir, verify, progress))
    except BaseException as e:
        aw.cancel()
        w.abort()
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise CheckpointError(f"no space left on device while writing {out_dir}; nothing was kept") from None
        raise
    return out_dir


def _quant_name(source: dict | None) -> str:
    q = source or {}
    q = q.get("quantization", q) if isinstance(q.get("quantization"), dict) else q
    return str(q.get("quant_algo") or q.get("quant_method") or "declared in its config")


def _digests(hasher: Hasher, stream: SourceStream) -> dict[str, str]:
    return dict(sorted({**hasher.result(), **stream.digests()}.items()))


def _verify(tmp: Path, out_dir: Path, mode: str, progress: bool) -> None:
    """The final check on the finished temp dir `tmp` (before it is renamed to `out_dir`): structure on open, then
    the sampled or full content pass; raising makes the writer remove `tmp`."""
    try:
        r = FtwReader(tmp)
    except FtwError as e:
        raise CheckpointError(f"{out_dir}: the written index does not validate ({e}); nothing was kept") from None
    plan = full_plan(r.records) if mode == "full" else sample_plan(r.records)
    total = plan_bytes(plan) + sum(a.nbytes for a in r.records.assets.values())
    with byte_progress(progress, "verify ", total) as advance:
        failures = check(r, plan, advance)
    if failures:
        raise CheckpointError(f"{out_dir}: verification failed after writing ({len(failures)} problems; first: "
                              f"{failures[0]}); nothing was kept")
    r.write_stamp()  # every digest came from the bytes written: a serving start need not hash them again
