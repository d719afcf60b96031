"""`ft launch claude|codex|opencode|crush|pi [--dry-run] [-- ARGS]`: start a coding agent on the running `ft serve`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import typer

from ft.cli.ctl_cmd import API_KEY, TIMEOUT, URL, CtlError, fetch


def _default_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ft" / "launch"


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def launch(
        tool: str = typer.Argument(..., help="claude, codex, opencode, crush or pi."),
        args: Optional[list[str]] = typer.Argument(None, help="Arguments for the tool (after --)."),
        url: str = URL,
        api_key: Optional[str] = API_KEY,
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the command, environment and files as JSON; "
                                                               "start nothing, write nothing."),
        workdir: Optional[Path] = typer.Option(None, "--dir", help="Where the tools' configs are written "
                                                                   "(default: ~/.cache/ft/launch)."),
        timeout: float = TIMEOUT,
    ) -> None:
        """Point a coding agent at the running server (its own config format, the served model's context window
        and output cap) and start it with cloud API keys removed from its environment."""
        from rich.console import Console

        from ft.cli.agents import TOOLS, Served, environment, plan_launch, write_files

        err = Console(stderr=True, soft_wrap=True)

        def fail(message: str) -> None:
            err.print(f"[red]error[/red]: {message}")
            raise typer.Exit(1)

        if tool not in TOOLS:
            fail(f"unknown tool {tool!r}; ft launch knows {', '.join(TOOLS)}")
        try:
            _, body = fetch(url, "/v1/models", api_key, timeout)
            served = Served.from_card(url, api_key, (body.get("data") or [{}])[0])
        except (CtlError, ValueError) as e:
            fail(str(e))
        plan = plan_launch(tool, served, workdir or _default_dir(), args)
        if dry_run:
            typer.echo(json.dumps(plan.as_dict(), indent=2))
            return
        binary = shutil.which(plan.argv[0])
        if binary is None:
            fail(f"{plan.argv[0]!r} is not installed (not on PATH); install {tool} first, or see what would run "
                 f"with --dry-run")
        write_files(plan)
        err.print(f"starting {tool} on {served.model} at {served.url} (context {served.context}, output "
                  f"{served.output}); removed from its environment: cloud API keys")
        os.execve(binary, plan.argv, environment(plan, dict(os.environ)))
