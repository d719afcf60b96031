"""`ft generate`: run one prompt through the engine and print the text as it decodes (or JSON with --json)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ft.cli.engine_flags import engine_flags
from ft.runtime.settings import EngineSettings


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_command)


@engine_flags(exit_code=1)
def generate_command(
    ftw: str = typer.Option(..., "--ftw", help="FTW model directory, or a Hugging Face repo id (org/name) one was "
                            "pushed to (pulled into the Hub cache)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Raw text prompt (tokenized as is)."),
    chat: Optional[str] = typer.Option(None, "--chat", help="A user message, wrapped in the model's chat template."),
    token_ids: Optional[str] = typer.Option(None, "--token-ids", help="Comma-separated prompt token ids: 1,2,3."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Output cap (clamped by --max-output-tokens)."),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", help="0 = greedy. Default: the model's generation_config, else 1.0."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Default: the model's generation_config, else 1."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="0 = off. Default: the model's generation_config."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (same seed, same tokens)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the model's end-of-sequence ids."),
    verify: bool = typer.Option(False, "--verify", help="Check every checksum of the FTW before loading."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: token ids, text, finish reason, "
                                                        "timings."),
    settings: EngineSettings = None,
) -> None:
    """Generate from a prompt with an FTW model (CPU, or CUDA with the GPU expert cache)."""
    sources = [s for s in (prompt, chat, token_ids) if s is not None]
    if len(sources) != 1:
        _fail("give exactly one of --prompt, --chat or --token-ids")

    from ft.formats import FtwError, FtwReader
    from ft.formats.hub import resolve_ftw
    from ft.runtime.engine import ContextOverflowError, Engine, generate
    from ft.runtime.sampling import params_from_generation_config

    try:
        reader = FtwReader(resolve_ftw(ftw))
        if verify:
            problems = reader.verify()
            if problems:
                _fail(str(problems[0]) + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        engine = Engine(reader, settings)
        if engine.placement is not None and not as_json:
            typer.echo(f"plan: {engine.placement.note}", err=True)
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
            **({"plan": engine.placement.stats()} if engine.placement is not None else {}),  # `ft plan`
        }))
    else:
        sys.stdout.write("\n")
        t = result.timings
        typer.echo(f"[{result.finish_reason}] {result.prompt_tokens} prompt + {len(result.token_ids)} output tokens; "
                   f"prefill {t['prefill_tok_s']:.1f} tok/s, decode {t['decode_tok_s']:.2f} tok/s, "
                   f"TTFT {t['ttft_s']:.3f} s", err=True)


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
