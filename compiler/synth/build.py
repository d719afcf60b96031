"""One synthetic checkpoint (and its NVFP4 / FP8 / FP4 twin) into prepared temporary directories: the steps behind
`synth`."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from ft.compiler.synth import hf_config
from ft.compiler.synth import routing as routing_mod
from ft.compiler.synth.nvfp4_checkpoint import quant_configs, scheme_of
from ft.compiler.synth.presets import GLM_VOCAB, MIXTRAL_VOCAB, TINY_RANKS, TOKENIZER_FLAVOR, Preset
from ft.compiler.synth.shards import Entry, tensor_entry, total_bytes, write_checkpoint
from ft.compiler.synth.tables import TensorSpec, meta_table, mtp_table
from ft.compiler.synth.weights import ValueContext

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_ranks(arch: str, preset: str, vocab_size: int | None) -> int | None:
    """BPE ranks to keep: TINY_RANKS for tiny presets; mixtral, glm4_moe and glm_moe_dsa keep their real embedding
    size (32000, 151552, 154880) with the Qwen3 ranks that fit below 32000 / 151552; else all ranks."""
    if preset == "tiny":
        return TINY_RANKS
    if arch in ("mixtral", "glm4_moe", "glm_moe_dsa"):
        default = MIXTRAL_VOCAB if arch == "mixtral" else GLM_VOCAB
        # leaves room for the Qwen3 specials below the embedding size (GLM-5's 154880 rows: GLM-4.5's ids and more)
        return min(vocab_size or default, default) - 64
    return None


def _console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _check_quantizable(arch: str, table: list[TensorSpec]) -> None:
    for t in table:
        if scheme_of(arch, t.name) == "nvfp4" and t.shape[-1] % 16:
            raise ValueError(f"nvfp4 needs in_features % 16 == 0; {t.name} has shape {list(t.shape)}")


def _entries(arch: str, preset: Preset, cfg, dtype: torch.dtype, quant: str, fused: bool,
             ctx: ValueContext) -> tuple[list[TensorSpec], list[Entry], list[Entry] | None, object]:
    """(table, checkpoint entries, twin entries, coverage source) for the preset's kind."""
    if preset.kind == "hf":
        from ft.compiler.synth.hf_small import build_state, build_table
        from ft.compiler.synth.nvfp4_checkpoint import quantize_state

        table = build_table(arch, cfg, dtype, fused)
        if quant == "nvfp4":
            _check_quantizable(arch, table)
        state = build_state(table, ctx)
        if quant == "none":
            return table, [tensor_entry(n, t) for n, t in state.items()], None, None
        if quant in ("fp8", "fp4"):
            from ft.compiler.synth import fp4_checkpoint, fp8_checkpoint

            q, twin = (fp8_checkpoint if quant == "fp8" else fp4_checkpoint).quantize_state(state)
        else:
            q, twin = quantize_state(arch, state, ctx.seed)
        return table, [tensor_entry(n, t) for n, t in q.items()], [tensor_entry(n, t) for n, t in twin.items()], None
    from ft.compiler.synth.full_size import FullSizeWriter

    table = _meta_tables(arch, cfg, dtype, fused)
    if quant == "nvfp4":
        _check_quantizable(arch, table)
    writer = FullSizeWriter(arch, ctx, quant)
    main, twin = writer.entries(table)
    return table, main, twin, writer


def _config(arch: str, preset: Preset, keys: dict, dtype: torch.dtype, tok_dir: Path):
    """Write the tokenizer files into tok_dir and build the transformers config: (tokenizer info, config)."""
    from ft.compiler.synth.tokenizer import write_tokenizer_files

    tok = write_tokenizer_files(tok_dir, TOKENIZER_FLAVOR[arch],
                                tokenizer_ranks(arch, preset.name, keys.get("vocab_size")))
    if preset.name == "tiny":
        keys["vocab_size"] = tok["vocab_size"]
    elif keys["vocab_size"] < tok["vocab_size"]:
        raise ValueError(f"vocab_size {keys['vocab_size']} is smaller than the tokenizer ({tok['vocab_size']} ids)")
    return tok, hf_config.build_config(arch, keys, tok, dtype)


def plan_table(*, arch: str, preset: Preset, keys: dict, dtype: torch.dtype, quant: str, fused: bool,
               tok_dir: Path) -> list[TensorSpec]:
    """The written table (quantized names included) from the meta device, without generating any data."""
    from ft.compiler.synth.full_size import FullSizeWriter

    _, cfg = _config(arch, preset, dict(keys), dtype, tok_dir)
    text = hf_config.text_config(cfg)
    table = _meta_tables(arch, cfg, dtype, fused)
    if quant == "nvfp4":
        _check_quantizable(arch, table)
    ctx = ValueContext(arch, text.hidden_size, text.num_hidden_layers, 0, "uniform")
    if quant in ("fp8", "fp4"):  # in-memory presets only (checked by synth._resolve)
        from ft.compiler.synth import fp4_checkpoint, fp8_checkpoint

        return (fp8_checkpoint if quant == "fp8" else fp4_checkpoint).quantized_table(table)
    main, _ = FullSizeWriter(arch, ctx, quant).entries(table)
    return [TensorSpec(e.name, e.shape, e.dtype) for e in main]


def _meta_tables(arch: str, cfg, dtype: torch.dtype, fused: bool) -> list[TensorSpec]:
    table = meta_table(arch, cfg, dtype, fused) + mtp_table(arch, cfg, dtype, fused)
    if hf_config.text_config(cfg).tie_word_embeddings:
        table = [t for t in table if t.name != "lm_head.weight"]  # save_pretrained drops tied weights
    return table


def build_checkpoint(*, arch: str, preset: Preset, keys: dict, dtype: torch.dtype, quant: str, routing: str,
                     seed: int, fused: bool, shard: int, out: Path, twin: Path | None) -> None:
    """Write the checkpoint into `out` and, when `twin` is a directory, its exact BF16 twin (NVFP4 / FP8 only).

    Without a twin directory a quantized checkpoint is written alone; in-memory presets (tiny/small/demo) still write
    their twin into a temporary directory, because the coverage report runs transformers on it (<= 380 MB)."""
    console = _console()
    tok, cfg = _config(arch, preset, keys, dtype, out)
    text = hf_config.text_config(cfg)
    ctx = ValueContext(arch, text.hidden_size, text.num_hidden_layers, seed, routing,
                       getattr(text, "n_routed_experts", 0) or 0)
    table, main, twin_entries, writer = _entries(arch, preset, cfg, dtype, quant, fused, ctx)

    with tempfile.TemporaryDirectory(prefix="ft-synth-twin-") as scratch:
        if quant in ("nvfp4", "fp8", "fp4") and twin is None and writer is None:
            twin = Path(scratch)
        _write_files(arch, cfg, tok, table, dtype, quant, out, twin)
        total = total_bytes(main) + (total_bytes(twin_entries) if twin is not None else 0)
        with _progress(console) as progress:
            task = progress.add_task(f"{arch} {preset.name}", total=total)
            advance = lambda n: progress.advance(task, n)  # noqa: E731
            write_checkpoint(out, main, shard, advance)
            if twin is not None:
                write_checkpoint(twin, twin_entries, shard, advance)
        cov = _coverage(arch, preset, twin or out, text, writer, table)
    console.print(f"routing {routing}: {routing_mod.summary(cov)}", highlight=False, markup=False)


def _write_files(arch: str, cfg, tok: dict, table: list[TensorSpec], dtype: torch.dtype, quant: str, out: Path,
                 twin: Path | None) -> None:
    """config.json / generation_config.json (+ NVFP4 / FP8 quant configs) in `out`; the twin's unquantized copies."""
    cfg.save_pretrained(out)  # transformers' own config.json, then rewritten like the real release
    config = hf_config.realistic_config(arch, json.loads((out / "config.json").read_text()), dtype)
    gen = hf_config.generation_config(arch, tok)
    if twin is not None:
        _write_json(twin / "config.json", config)
        _write_json(twin / "generation_config.json", gen)
        for f in TOKENIZER_FILES:
            shutil.copyfile(out / f, twin / f)
    if quant == "nvfp4":
        qc, legacy = quant_configs(arch, [t.name for t in table])
        config = dict(config, quantization_config=qc)
        (out / "hf_quant_config.json").write_text(json.dumps(legacy) + "\n")
    elif quant == "fp8":
        from ft.compiler.synth.fp8_checkpoint import quant_config

        config = dict(config, quantization_config=quant_config(arch, table))
    elif quant == "fp4":  # DeepSeek-V4: expert_dtype at the top level, as V4's config.json has it
        from ft.compiler.synth.fp4_checkpoint import CONFIG, EXPERT_DTYPE

        config = dict(config, quantization_config=dict(CONFIG), expert_dtype=EXPERT_DTYPE)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", gen)


def _coverage(arch: str, preset: Preset, model_dir: Path, text, writer, table) -> list[routing_mod.Coverage]:
    """Measured (transformers forward) for in-memory presets; estimated from weights for full-size ones."""
    if writer is not None:
        return writer.estimate_coverage(table, text.num_experts_per_tok)
    from ft.compiler.synth.hf_small import load_reference, measure_coverage

    model = load_reference(model_dir, arch)
    return measure_coverage(model, text.vocab_size, num_tokens=512)


def _progress(console):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)
