"""`ft verify` and `ft inspect`: thin wrappers over ft.formats."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
    app.command("inspect")(inspect)


def verify(path: Path = typer.Argument(..., help="FTW directory")) -> None:
    """Check every validation rule and every checksum of an FTW directory. Exit 0 if sound, 1 if not."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ft.formats import FtwError, FtwReader
    from ft.formats.verify import total_bytes

    console = Console(stderr=True, soft_wrap=True)
    try:
        r = FtwReader(path, checksums="off")
    except FtwError as e:
        console.print(f"[red]FAIL[/red] {escape(str(e))}")
        raise typer.Exit(1)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("verifying", total=total_bytes(r))
        failures = r.verify(lambda n: bar.advance(task, n))
    for f in failures:
        console.print(f"[red]FAIL[/red] {escape(str(f))}")
    if failures:
        raise typer.Exit(1)
    r.write_stamp()  # a later open of the unchanged files skips the lazy checksums (FtwReader.verified)
    console.print(f"[green]OK[/green] {path}: {len(r.tensor_names())} tensors, {len(r.bank_names())} expert banks, "
                  f"{total_bytes(r) / 2**20:.1f} MiB checked")
    from ft.formats.kernels import describe

    for k in describe(r):
        console.print(f"kernels {escape(_kernel_set(k))}")


def inspect(path: Path = typer.Argument(..., help="FTW directory"),
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Summarize an FTW: family, parameters, layers, experts, formats, bytes by kind, plans, kernels."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ft.formats import FtwError, FtwReader
    from ft.formats.summary import summarize

    try:
        s = summarize(FtwReader(path, checksums="off"))
    except FtwError as e:
        Console(stderr=True, soft_wrap=True).print(f"[red]FAIL[/red] {escape(str(e))}")
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(s, indent=2))
        return
    p, L, x, b = s["parameters"], s["layers"], s["experts"], s["bytes"]
    t = Table(title=f"{path} (FTW {s['format_version'][0]}.{s['format_version'][1]})", show_header=False)
    t.add_row("family", s["family"])
    t.add_row("parameters", f"{_human(p['total'])} total, {_human(p['active_per_token'])} active per token "
                            f"({_human(p['dense'])} dense + {_human(p['experts'])} in experts)")
    sliding = f"{L['sliding_attention']} sliding-window attention, " if L["sliding_attention"] else ""
    t.add_row("layers", f"{L['total']} ({L['full_attention']} full attention, {sliding}"
                        f"{L['linear_attention']} linear attention; {L['moe']} MoE)")
    t.add_row("experts", f"{x['per_layer']} per layer, top-{x['per_token']}"
                         + (f", shared expert {x['shared_expert_intermediate']}"
                            if x["shared_expert_intermediate"] else ""))
    t.add_row("formats", f"banks {s['formats']['expert_banks']}, "
                         f"quantized linears {s['formats']['linears'] or 'none'}, "
                         f"dense dtypes {s['formats']['dense_dtypes']}")
    t.add_row("bytes", f"dense {_mib(b['dense'])}, experts {_mib(b['experts'])}, assets {_mib(b['assets'])}; "
                       f"{b['num_data_files']} data file(s), {_mib(b['data_files'])}")
    t.add_row("plans", _plans_text(s) or "none")
    t.add_row("kernels", "\n".join(_kernel_set(k) for k in s["kernel_sets"]) or "none")
    t.add_row("source", json.dumps(s["provenance"]))
    Console().print(t)


def _kernel_set(k: dict) -> str:
    """One line per kernels/ entry: target, Triton, count, size, and whether this machine trusts it."""
    if "error" in k:
        return f"{k['name']}: unreadable ({k['error']})"
    trust = f"trusted: {k['trusted']}" if k["trusted"] else "not trusted on this machine (the runtime compiles instead)"
    return (f"{k['name']}: sm_{k['arch']}, triton {k['triton']}, {k['kernels']} kernels, {_mib(k['nbytes'])}; "
            f"{trust}")


def _plans_text(s: dict) -> str:
    """Each placement plan with its machine and prediction (other plans/ entries by name)."""
    lines = []
    for p in s["placement_plans"]:
        if "error" in p:
            lines.append(f"{p['name']}: unreadable ({p['error']})")
        else:
            pre = f", prefill {p['prefill_tok_s']:.0f}" if p["prefill_tok_s"] is not None else ""
            lines.append(f"{p['name']}: {p['gpu']}, VRAM budget {p['vram_budget'] / 2**30:.2f} GiB, host RAM "
                         f"{p['host_memory'] / 2**30:.0f} GiB; {p['expert_slots']} expert slots, KV "
                         f"{p['kv_tokens']} tokens, routing {p['routing']}; predicted decode "
                         f"{p['decode_tok_s']:.1f}{pre} tok/s")
    named = {f"plans/{p['name']}.json" for p in s["placement_plans"]}
    return "\n".join(lines + [n for n in s["plans"] if n not in named])


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
