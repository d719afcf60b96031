"""The engine's flags of `ft serve` and `ft generate`, generated from `EngineSettings` (one declaration per setting).

    @engine_flags(exit_code=2)
    def serve(ftw: Path = typer.Option(...), ..., settings: EngineSettings = None) -> None: ...

The decorated command's typer signature is its own parameters (minus `settings`) plus one option per EngineSettings
field (its flag, help and default from the field's metadata). The wrapper builds the settings from those options —
the one place they are validated — and passes them as `settings`; a bad value prints `error: <every problem>` and
exits with `exit_code`. Before that (validating `--device` imports torch: seconds on a cold disk), it starts the
read-ahead of the command's local FTW (`ft.formats.prefetch`), so that the disk reads the weights during the imports.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from typing import Any, Callable, Optional

import typer

from ft.formats.prefetch import start_prefetch
from ft.runtime.settings import EngineSettings


def _option(f) -> inspect.Parameter:
    meta = f.metadata
    default = meta.get("cli_default", f.default if f.default is not MISSING else None)
    kind = meta.get("cli_type", type(f.default))
    annotation = Optional[kind] if default is None else kind
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *meta["flag"].split(" "), help=meta["help"]))


def engine_flags(exit_code: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "settings"]
        names = [f.name for f in fields(EngineSettings)]
        params = own + [_option(f) for f in fields(EngineSettings)]

        def command(**kw: Any) -> Any:
            start_prefetch(kw.get("ftw"))  # first: a local FTW's disk reads what the load needs during the imports
            try:
                settings = EngineSettings(**{n: kw.pop(n) for n in names})
            except ValueError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(exit_code) from None
            return fn(settings=settings, **kw)

        command.__name__, command.__doc__ = fn.__name__, fn.__doc__
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
