"""`ft plan`: write a placement plan for this machine into an FTW, or show one (library: ft.runtime.plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    ftw: Path = typer.Option(..., "--ftw", help="FTW directory the plan is written into (plans/NAME.json)."),
    vram_budget: Optional[str] = typer.Option(None, "--vram-budget", help="The device memory `ft serve` will be "
                                              "given, e.g. 8GiB. Default: 0.9 of the free VRAM now (needed without "
                                              "a GPU: the plan is then for the CPU emulation)."),
    pinned_memory: Optional[str] = typer.Option(None, "--pinned-memory", help="Host memory the expert banks may "
                                                "page-lock, e.g. 16GiB. Default: half of the memory available now."),
    routing: Optional[Path] = typer.Option(None, "--routing", help="Routing counts a server wrote at shutdown "
                                           "(`ft serve --save-routing FILE`)."),
    calibrate: Optional[int] = typer.Option(None, "--calibrate", help="Count routing over N tokens of built-in text "
                                            "run through the model on this machine's device."),
    name: Optional[str] = typer.Option(None, "--name", help="Plan name (default: GPU and budget, e.g. "
                                       "nvidia-h200-8gib); a plan of that name is replaced."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write plan-NAME.txt and plan-NAME.html (heat "
                                          "map, predicted speed against the VRAM budget) into this directory."),
    show: Optional[str] = typer.Option(None, "--show", help="Print the stored plan NAME (and draw it with --report); "
                                       "nothing is planned or written."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]: the GPU planned for (and that "
                                                        "--calibrate runs on)."),
    kv_reserve_tokens: Optional[int] = typer.Option(None, "--kv-reserve-tokens", help="KV budget in tokens, as "
                                                    "`ft serve` takes it. Default: sized from the budget."),
    max_running_requests: int = typer.Option(4, "--max-running-requests", help="As `ft serve` will run."),
    dense_weights: str = typer.Option("auto", "--dense-weights", help="As `ft serve` will run: auto, dequantized "
                                      "or quantized."),
    cpu_lane: bool = typer.Option(True, "--cpu-lane/--no-cpu-lane", help="As `ft serve` will run: the CPU computes "
                                  "a share of the misses, or the GPU copies every one."),
) -> None:
    """Plan how this model runs on this machine: VRAM split, the experts that start resident (from routing counts,
    calibration or the uniform prior), page-locked banks, and the predicted decode / prefill tok/s with the
    arithmetic. `ft serve` and `ft generate` start from the plan that matches their machine."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress

    from ft.formats import FtwError, FtwReader
    from ft.formats.layout import is_safe_name
    from ft.formats.plan import model_key, read_plan
    from ft.runtime.plan.build import make_plan, write_plan
    from ft.runtime.plan.report import summary, write_report
    from ft.runtime.plan.routing import RoutingProfile, load_counts
    from ft.runtime.settings import EngineSettings

    err = Console(stderr=True, soft_wrap=True)

    def fail(msg: str, code: int = 1) -> None:
        err.print(f"[red]error[/red]: {escape(msg)}")
        raise typer.Exit(code)

    if routing is not None and calibrate is not None:
        fail("give --routing FILE or --calibrate N, not both", 2)
    if name is not None and not is_safe_name(name + ".json"):
        fail(f"--name {name!r}: use letters, digits, '_', '.' and '-' (a plain file name)", 2)
    try:
        settings = EngineSettings(device=device, vram_budget=vram_budget, pinned_memory=pinned_memory,
                                  kv_reserve_tokens=kv_reserve_tokens, max_running_requests=max_running_requests,
                                  dense_weights=dense_weights, cpu_lane=cpu_lane)
    except ValueError as e:
        fail(str(e), 2)
    try:
        reader = FtwReader(ftw)
        if show is not None:
            p = read_plan(reader, show)
        else:
            measured = None
            moe = [i for i, t in enumerate(reader.config.mlp_types) if t == "moe"]
            if routing is not None:
                profile = load_counts(routing, key=model_key(reader.records), moe_layers=moe,
                                      num_experts=reader.config.num_experts)
            elif calibrate is not None:
                from ft.runtime.plan.calibrate import calibrate as run_calibration

                make_plan(reader, settings, RoutingProfile.uniform(""), name=name)  # a budget too small: refused now

                with Progress("calibrating", BarColumn(), MofNCompleteColumn(), console=err, transient=True) as bar:
                    task = bar.add_task("tokens", total=calibrate)
                    profile, measured = run_calibration(reader, calibrate, settings,
                                                        progress=lambda n: bar.advance(task, n))
            else:
                profile = RoutingProfile.uniform("no --routing or --calibrate: every expert equally likely")
            p = make_plan(reader, settings, profile, name=name, measured=measured)
            write_plan(ftw, p)
    except (FtwError, KeyError, ValueError, OSError) as e:
        fail(str(e).strip('"'))
    typer.echo(summary(p))
    if show is None:
        err.print(f"written: {ftw / p.entry}")
    if report is not None:
        for path in write_report(p, report):
            err.print(f"report: {path}")
