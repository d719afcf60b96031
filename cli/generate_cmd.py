"""`ft generate`: run one prompt through the engine and print the text as it decodes (or JSON with --json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ft.cli.gpu_options import DENSE_WEIGHTS, ENFORCE_EAGER, OFFLOAD_MODE


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_command)


def generate_command(
    ftw: Path = typer.Option(..., "--ftw", help="FTW model directory."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Raw text prompt (tokenized as is)."),
    chat: Optional[str] = typer.Option(None, "--chat", help="A user message, wrapped in the model's chat template."),
    token_ids: Optional[str] = typer.Option(None, "--token-ids", help="Comma-separated prompt token ids: 1,2,3."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Output cap (clamped by the engine's 32768)."),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", help="0 = greedy. Default: the model's generation_config, else 1.0."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Default: the model's generation_config, else 1."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="0 = off. Default: the model's generation_config."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (same seed, same tokens)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the model's end-of-sequence ids."),
    kv_reserve_tokens: int = typer.Option(8192, "--kv-reserve-tokens", help="KV budget in tokens."),
    max_prefill_length: int = typer.Option(2048, "--max-prefill-length", help="Prompt tokens per prefill step."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available, else cpu), cpu, or cuda[:N]."),
    vram_budget: Optional[str] = typer.Option(None, "--vram-budget",
                                              help="CUDA only: VRAM for everything the engine allocates, e.g. 8GiB "
                                                   "or 12e9; overrides --memory-ratio."),
    memory_ratio: float = typer.Option(0.9, "--memory-ratio",
                                       help="CUDA only: share of free GPU memory to use when --vram-budget is not "
                                            "given, in (0, 1]."),
    dense_weights: str = DENSE_WEIGHTS,
    offload_mode: str = OFFLOAD_MODE,
    enforce_eager: bool = ENFORCE_EAGER,
    verify: bool = typer.Option(False, "--verify", help="Check every checksum of the FTW before loading."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: token ids, text, finish reason, "
                                                        "timings."),
) -> None:
    """Generate from a prompt with an FTW model (CPU, or CUDA with the GPU expert cache)."""
    sources = [s for s in (prompt, chat, token_ids) if s is not None]
    if len(sources) != 1:
        _fail("give exactly one of --prompt, --chat or --token-ids")

    from ft.formats import FtwError, FtwReader
    from ft.runtime.engine import ContextOverflowError, Engine, generate
    from ft.runtime.sampling import params_from_generation_config

    try:
        device = _device(device)
        budget = None
        if vram_budget is not None:
            from ft.runtime.gpu.sizing import parse_bytes

            budget = parse_bytes(vram_budget)
        if not 0 < memory_ratio <= 1:
            raise ValueError(f"--memory-ratio must be in (0, 1], got {memory_ratio}")
        if dense_weights not in ("dequantized", "quantized"):
            raise ValueError(f"--dense-weights {dense_weights!r}; use dequantized or quantized")
        from ft.runtime.gpu.offload_config import FLAG_MODES

        if offload_mode not in FLAG_MODES:
            raise ValueError(f"--offload-mode {offload_mode!r}; use one of {', '.join(FLAG_MODES)}")
    except ValueError as e:
        _fail(str(e))
    try:
        reader = FtwReader(ftw)
        if verify:
            problems = reader.verify()
            if problems:
                _fail(str(problems[0]) + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        engine = Engine(reader, device=device, kv_reserve_tokens=kv_reserve_tokens,
                        max_prefill_length=max_prefill_length, vram_budget=budget, memory_ratio=memory_ratio,
                        dense_weights=dense_weights, offload_mode=offload_mode if device.startswith("cuda") else None,
                        cuda_graphs=not enforce_eager)
    except FtwError as e:  # structural problems, unknown family (V19), bad config
        _fail(str(e))
    except ValueError as e:
        _fail(f"{ftw}: {e}")

    try:
        ids = _prompt_ids(engine, prompt, chat, token_ids)
        params = params_from_generation_config(engine.generation_config, max_tokens=max_tokens,
                                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                               ignore_eos=ignore_eos)
        on_event = None if as_json else _print_delta
        result = generate(engine, ids, params, on_event=on_event)
    except (ContextOverflowError, ValueError) as e:
        _fail(str(e))

    if as_json:
        typer.echo(json.dumps({
            "prompt_token_ids": ids, "token_ids": result.token_ids, "text": result.text,
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "output_tokens": len(result.token_ids), "timings": result.timings,
            **({"moe": moe} if (moe := engine.stats().get("moe")) else {}),  # GPU expert cache counters
        }))
    else:
        sys.stdout.write("\n")
        t = result.timings
        typer.echo(f"[{result.finish_reason}] {result.prompt_tokens} prompt + {len(result.token_ids)} output tokens; "
                   f"prefill {t['prefill_tok_s']:.1f} tok/s, decode {t['decode_tok_s']:.2f} tok/s, "
                   f"TTFT {t['ttft_s']:.3f} s", err=True)


def _device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device {device!r}; use auto, cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA GPU on this machine")
    return device


def _prompt_ids(engine, prompt: str | None, chat: str | None, token_ids: str | None) -> list[int]:
    if token_ids is not None:
        try:
            ids = [int(x) for x in token_ids.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"--token-ids must be comma-separated integers, got {token_ids!r}") from None
        if not ids:
            raise ValueError("--token-ids is empty")
        return ids
    if chat is not None:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True)
        return engine.tokenizer.encode(text, add_special_tokens=False)
    return engine.tokenizer.encode(prompt, add_special_tokens=True)


def _print_delta(event) -> None:
    if event.text:
        sys.stdout.write(event.text)
        sys.stdout.flush()


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)
