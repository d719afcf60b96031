"""The `ft` command: thin typer commands that parse flags and call one library function each.

Each command module under `ft.cli` exposes `register(app)`. Heavy imports (torch, transformers, fastapi) happen
inside the command bodies so `ft --version` and `ft --help` stay fast.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _dist_version

import typer

# One entry per command module; a module is listed only once its commands work end to end.
COMMAND_MODULES = [
    "ft.cli.formats_cmd",
    "ft.cli.bench_cmd",
    "ft.cli.generate_cmd",
    "ft.cli.checkpoint_cmd",
    "ft.cli.serve_cmd",
    "ft.cli.ctl_cmd",
    "ft.cli.launch_cmd",
    "ft.cli.synth_cmd",
    "ft.cli.bundle_cmd",
    "ft.cli.kernels_cmd",
    "ft.cli.plan_cmd",
]

app = typer.Typer(
    name="ft",
    help="Compile Hugging Face MoE checkpoints into FTW and serve them with hybrid CPU/GPU expert offload.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"ft {_dist_version('ft-moe')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """ft: FTW compiler and MoE runtime."""


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()
