"""`ft bundle pack|unpack|verify` and `ft trust keygen|add|list`: thin wrappers over ft.formats.bundle / trust."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

bundle_app = typer.Typer(help="Pack a compiled FTW into one file, unpack and verify it on another machine.",
                         no_args_is_help=True)
trust_app = typer.Typer(help="Keys that sign bundles, and the ones this machine trusts.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bundle_app, name="bundle")
    app.add_typer(trust_app, name="trust")


@contextlib.contextmanager
def _bar(what: str, total: int):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def _fail(e: Exception) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[red]FAIL[/red] {escape(str(e))}")
    raise typer.Exit(1)


def _report(manifest: dict, seconds: float) -> None:
    from ft.formats.bundle import sizes_by_kind

    plain = packed = 0
    for kind, s in sorted(sizes_by_kind(manifest).items()):
        plain, packed = plain + s["plain"], packed + s["packed"]
        typer.echo(f"  {kind:8s} {s['plain'] / 2**20:10.1f} MiB -> {s['packed'] / 2**20:10.1f} MiB "
                   f"({s['packed'] / max(1, s['plain']):.2f})")
    typer.echo(f"  {'total':8s} {plain / 2**20:10.1f} MiB -> {packed / 2**20:10.1f} MiB in {seconds:.1f} s "
               f"({plain / max(seconds, 1e-9) / 1e9:.2f} GB/s of model)")


@bundle_app.command("pack")
def pack(src: Path = typer.Argument(..., help="FTW directory"), out: Path = typer.Argument(..., help="bundle file"),
         sign: Path | None = typer.Option(None, "--sign", help="Private key (ft trust keygen) to sign with."),
         level: int = typer.Option(3, "--level", help="zstd level (1-19)."),
         threads: int | None = typer.Option(None, "--threads", help="Compression threads (default: all cores).")):
    """Write an FTW directory as one bundle file: zstd chunks, sha256 per file, optionally signed."""
    import time

    from ft.formats import bundle, trust

    try:
        signer = trust.Signer(sign) if sign else None
        total = sum(p.stat().st_size for p in Path(src).rglob("*") if p.is_file())
        t = time.perf_counter()
        with _bar("packing", total) as advance:
            manifest = bundle.pack(src, out, level=level, threads=threads, signer=signer, progress=advance)
    except (OSError, ValueError) as e:
        _fail(e)
    typer.echo(f"{out}: {len(manifest['files'])} files" + (f", signed by {signer.public}" if signer else ""))
    _report(manifest, time.perf_counter() - t)


@bundle_app.command("unpack")
def unpack(src: Path = typer.Argument(..., help="bundle file"),
           dest: Path = typer.Argument(..., help="new FTW directory (an interrupted unpack resumes into it)"),
           threads: int | None = typer.Option(None, "--threads", help="Decompression threads.")):
    """Unpack a bundle into an FTW directory, checking every chunk's hash, then check the FTW (every structural rule
    and a sample of its checksums; `ft verify DIR` re-reads all of it)."""
    import time

    from ft.formats import FtwReader, bundle, kernel_trust
    from ft.formats.verify import SAMPLE_BYTES, verify_sample

    try:
        manifest, body, signature = bundle.read_manifest(src)
        signer, key = _signer(body, signature)
        t = time.perf_counter()
        with _bar("unpacking", sum(e["size"] for e in manifest["files"])) as advance:
            bundle.unpack(src, dest, threads=threads, progress=advance)
        seconds = time.perf_counter() - t
        r = FtwReader(dest, checksums="off")
        with _bar("checking", SAMPLE_BYTES) as advance:
            failures = verify_sample(r, progress=advance)
        if failures:
            raise ValueError("; ".join(str(f) for f in failures))
        if key is not None:  # the bytes just written are the signer's: its kernels may run here
            kernel_trust.trust_ftw(dest, f"unpacked from a bundle signed by trusted key {key}")
    except (OSError, ValueError) as e:
        _fail(e)
    typer.echo(f"{dest}: {len(manifest['files'])} files, FTW verified; {signer}{_kernels_note(manifest, key, dest)}")
    _report(manifest, seconds)


@bundle_app.command("verify")
def verify(src: Path = typer.Argument(..., help="bundle file")):
    """Check a bundle without unpacking it: structure, every chunk, every file's sha256, the signature."""
    from ft.formats import bundle

    try:
        manifest, body, signature = bundle.read_manifest(src)
        signer, key = _signer(body, signature)
        with _bar("verifying", sum(e["size"] for e in manifest["files"])) as advance:
            bundle.verify(src, progress=advance)
    except (OSError, ValueError) as e:
        _fail(e)
    typer.echo(f"OK {src}: {len(manifest['files'])} files; {signer}{_kernels_note(manifest, key)}")


@bundle_app.command("push")
def push(src: Path = typer.Argument(..., help="FTW directory"),
         repo_id: str = typer.Argument(..., help="Hugging Face model repo (org/name), created if missing"),
         revision: str | None = typer.Option(None, "--revision", help="Branch to push to (created if missing)."),
         private: bool = typer.Option(False, "--private", help="Create the repo private.")):
    """Upload an FTW directory to the Hugging Face Hub (HF_TOKEN; large files resume)."""
    from ft.formats import hub

    try:
        url = hub.push(src, repo_id, revision=revision, private=private)
    except Exception as e:  # noqa: BLE001 - network, auth and Hub errors end the command with one line
        _fail(e)
    typer.echo(f"pushed {src} to {repo_id}: {url}")


@bundle_app.command("pull")
def pull(repo_id: str = typer.Argument(..., help="Hugging Face model repo (org/name) holding an FTW"),
         revision: str | None = typer.Option(None, "--revision", help="Branch, tag or commit."),
         out: Path | None = typer.Option(None, "--out", help="Place it here too (default: the Hub cache only).")):
    """Download a pushed FTW into the Hub cache (HF_HOME; resumes; HF_HUB_OFFLINE uses the cache only)."""
    from ft.formats import hub

    try:
        path = hub.pull(repo_id, revision=revision, out=out)
    except (OSError, ValueError) as e:
        _fail(e)
    typer.echo(f"{repo_id}: {path}")


def _signer(body: bytes, signature: dict | None) -> tuple[str, str | None]:
    """(what to say about the signature, the trusted key that signed or None)."""
    from ft.formats import trust

    key = trust.check(body, signature, trust.trusted_keys())
    if key is not None:
        return f"signed by trusted key {key}", key
    if signature is None:
        return "unsigned", None
    return f"signed by {signature.get('key')}, a key this machine does not trust", None


def _kernels_note(manifest: dict, key: str | None, dest: Path | None = None) -> str:
    """Whether the bundle's prebuilt kernels would be trusted here by its signature, or (`dest`: unpacked there) are
    trusted here now, by this signature or an earlier build or unpack of the same bytes."""
    n = sum(e["kind"] == "kernels" for e in manifest["files"])
    if not n:
        return ""
    if dest is not None:
        from ft.formats.kernels import describe

        ok = sum(bool(k.get("trusted")) for k in describe(dest))
        if ok == n:
            return f"; its {n} kernels entries are trusted here"
        return f"; {n - ok} of its {n} kernels entries are NOT trusted here (the runtime compiles those kernels itself)"
    if key is not None:
        return f"; its {n} kernels entries are trusted (the signature covers them)"
    return f"; its {n} kernels entries are NOT trusted (unsigned, or not by a trusted key)"


@trust_app.command("keygen")
def keygen(out: Path = typer.Argument(..., help="private key file to create (its public key goes to OUT.pub)")):
    """Make an ed25519 key pair for signing bundles."""
    from ft.formats import trust

    try:
        pub = trust.keygen(out)
    except (OSError, ValueError) as e:
        _fail(e)
    typer.echo(f"private key {out} (keep it secret), public key {pub} ({out}.pub)")


@trust_app.command("add")
def add(key: str = typer.Argument(..., help="public key, 64 hex digits")):
    """Trust bundles signed by this key on this machine."""
    from ft.formats import trust

    try:
        path = trust.add(key)
    except (OSError, ValueError) as e:
        _fail(e)
    typer.echo(f"trusted {key.strip().lower()} ({path})")


@trust_app.command("list")
def list_keys():
    """The public keys this machine trusts."""
    from ft.formats import trust

    for key in sorted(trust.trusted_keys()):
        typer.echo(key)
