"""`ft serve`: OpenAI- and Anthropic-compatible server over one FTW (see specs/server.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ft.cli.engine_flags import engine_flags
from ft.runtime.settings import EngineSettings


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@engine_flags(exit_code=2)
def serve(
    ftw: str = typer.Option(..., "--ftw", help="FTW directory written by `ft checkpoint`, or a Hugging Face repo id "
                            "(org/name) one was pushed to (`ft bundle push`; pulled into the Hub cache)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit of a repo id --ftw."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address. The default serves this machine only; "
                             "0.0.0.0 exposes the server to the network (set --api-key)."),
    port: int = typer.Option(1919, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FT_API_KEY",
                                          help="Require this key as 'Authorization: Bearer KEY' or 'x-api-key' "
                                               "(/health stays open). Default: $FT_API_KEY, else no auth."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id in /v1/models and responses "
                                                         "(default: the FTW directory name)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    max_request_bytes: int = typer.Option(32 << 20, "--max-request-bytes",
                                          help="Largest request body accepted; a larger one gets 413 unparsed."),
    keep_alive_on_error: bool = typer.Option(False, "--keep-alive-on-error",
                                             help="If the model cannot load, keep serving /health (500 with the "
                                                  "error) instead of exiting with status 1."),
    settings: EngineSettings = None,
) -> None:
    """Serve an FTW with OpenAI (/v1/chat/completions, /v1/completions, /v1/responses) and Anthropic
    (/v1/messages) APIs. The port is bound at once; GET /health answers 503 until the weights are loaded."""
    from rich.console import Console

    from ft.runtime.server.state import ServeSettings

    from ft.formats import FtwError
    from ft.formats.hub import HubError, resolve_ftw

    err = Console(stderr=True, soft_wrap=True)
    try:
        local = resolve_ftw(ftw, revision=revision)
    except (HubError, FtwError) as e:
        err.print(f"[red]error[/red]: --ftw {e}")
        raise typer.Exit(2)
    if local != Path(ftw) and served_model_name is None:
        served_model_name = ftw.split("/")[-1]  # the repo's name, not the cache's snapshot hash
    ftw = local
    if log_level not in ("debug", "info", "warning", "error"):
        err.print(f"[red]error[/red]: --log-level {log_level!r}; use debug, info, warning or error")
        raise typer.Exit(2)
    try:
        serve_settings = ServeSettings(ftw=ftw, engine=settings, host=host, port=port, api_key=api_key,
                                       served_model_name=served_model_name, keep_alive_on_error=keep_alive_on_error,
                                       max_request_bytes=max_request_bytes)
    except ValueError as e:
        err.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2)
    from ft.runtime.server.app import ServeFailed
    from ft.runtime.server.app import serve as run_server

    err.print(f"serving [bold]{serve_settings.model_name}[/bold] from {ftw} on http://{host}:{port} (device "
              f"{settings.device}); auth {'on' if api_key else 'off'}")
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning[/yellow]: --host {host} without --api-key: anyone who can reach this machine "
                  f"can use the server; set --api-key (or FT_API_KEY)")
    try:
        run_server(serve_settings, log_level=log_level)
    except ServeFailed as e:
        err.print(f"[red]error[/red]: the model cannot be served: {e}; exiting (--keep-alive-on-error keeps the "
                  f"server up, reporting the error on /health)")
        raise typer.Exit(1)
