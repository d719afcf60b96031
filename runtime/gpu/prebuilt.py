"""Prebuilt kernels at engine start: pick the FTW's kernels entry for this Triton build and GPU, check it, and install
it into Triton's cache before any kernel launches, so that no kernel compiles (specs/ftw.md §5.7).

    status = use_prebuilt(reader, arch)    # one log line: what was installed, or why nothing was (then Triton JITs)

The decision, in order: no entries -> none; no entry for this arch -> other arch; none built by this Triton version
-> other Triton; none by this exact Triton build, ptxas or cache-relevant environment -> other build; the chosen
file's bytes differ from the manifest's digest or its structure is invalid -> tampered (refused, an error line); its
sha256 is not in this machine's trusted list (`formats.kernel_trust`: built here, or unpacked from a bundle signed
by a trusted key) -> not trusted; else installed. Kernels whose runtime source changed since the build are left
out (their launches compile) and counted in the line. The entry's host launchers (native code, trusted with it) are
installed too where they were built for this process' Python ABI and platform; else Triton builds them, as the line
says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ft.formats import FtwReader, kernel_trust
from ft.formats.errors import FtwError
from ft.formats.kernels import KernelSet, read_index, unpack
from ft.formats.layout import xxh3_hex

from . import triton_cache

log = logging.getLogger("ft.gpu")
_HINT = "; Triton compiles each kernel on first use"


@dataclass(frozen=True)
class Candidate:
    """One kernels/ entry as its index describes it (no blob read)."""
    name: str
    triton: str
    triton_build: str
    arch: int
    backend_key: str
    env: dict = field(default_factory=dict)


@dataclass
class KernelStatus:
    """What start-up did with the FTW's kernels: `decision` (installed, none, other-arch, other-triton, other-build,
    tampered, untrusted, unavailable), the line logged, and the counts."""
    decision: str
    message: str
    entry: str | None = None
    installed: int = 0
    stale: int = 0
    launchers: int = 0
    counter: triton_cache.CompileCounter | None = None

    def stats(self) -> dict:
        c = self.counter
        return {"prebuilt": self.decision, "entry": self.entry, "installed": self.installed, "stale": self.stale,
                "launchers_installed": self.launchers, "compiled_since_start": c.compiled if c else None,
                "compiled": list(c.names) if c else []}


def choose(candidates: list[Candidate], want: dict) -> tuple[Candidate | None, str, str]:
    """The entry matching `want` (`triton_cache.target_key`), else None; with (decision, reason)."""
    arch, ver = want["arch"], want["triton"]
    if not candidates:
        return None, "none", "none in this FTW (ft kernels build makes them)"
    same_arch = [c for c in candidates if c.arch == arch]
    if not same_arch:
        archs = ", ".join(sorted({f"sm_{c.arch}" for c in candidates}))
        return None, "other-arch", f"built for {archs}, not for this GPU's sm_{arch}"
    same_ver = [c for c in same_arch if c.triton == ver]
    if not same_ver:
        vers = ", ".join(sorted({c.triton for c in same_arch}))
        return None, "other-triton", f"built for sm_{arch} with Triton {vers}, this is Triton {ver}"
    for c in same_ver:
        if (c.triton_build, c.backend_key, c.env) == (want["triton_build"], want["backend_key"], want["env"]):
            return c, "installed", ""
    c = same_ver[0]
    if c.triton_build != want["triton_build"]:
        why = f"another build of Triton {ver} (another Python version or platform, or a modified install)"
    elif c.backend_key != want["backend_key"]:
        why = "another ptxas (TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH differ)"
    else:
        why = f"Triton environment {c.env}, this process has {want['env']}"
    return None, "other-build", f"built for sm_{arch} by {why}"


def candidates(reader: FtwReader) -> tuple[list[Candidate], list[str]]:
    """The FTW's kernels entries as candidates, and one note per entry whose index cannot be read."""
    out, bad = [], []
    for entry in reader.records.slots["kernels"]:
        path = reader.path / entry.name
        try:
            with open(path, "rb") as f:
                ix, _ = read_index(f.read(), path)
        except (OSError, FtwError) as e:
            bad.append(str(e))
            continue
        out.append(Candidate(entry.name, ix["triton"], ix["triton_build"], ix["arch"], ix["backend_key"], ix["env"]))
    return out, bad


def load_trusted(reader: FtwReader, name: str) -> tuple[KernelSet | None, str, str]:
    """(kernel set, "installed", how it is trusted) or (None, "tampered" | "untrusted", why) for entry `name`."""
    rec = next(e for e in reader.records.slots["kernels"] if e.name == name)
    path = reader.path / name
    try:
        data = path.read_bytes()
    except OSError as e:
        return None, "tampered", f"{path} cannot be read ({e}): refused"
    if len(data) != rec.nbytes or xxh3_hex(data) != rec.xxh3:
        return None, "tampered", f"{path} does not match the manifest's size and digest: refused (tampered or damaged)"
    try:
        ks = unpack(data, path)
    except FtwError as e:
        return None, "tampered", f"refused: {e}"
    how = kernel_trust.trusted(kernel_trust.digest(data))
    if how is None:
        return None, "untrusted", (f"{name} is not trusted on this machine (neither built here nor unpacked from a "
                                   f"bundle signed by a trusted key: ft kernels build, ft trust)")
    return ks, "installed", how


def use_prebuilt(reader: FtwReader, arch: int) -> KernelStatus:
    """Install the matching trusted kernels into Triton's cache (call before any kernel launches) and log one line."""
    counter = triton_cache.CompileCounter.get()
    try:
        want = triton_cache.target_key(arch)
    except Exception as e:  # noqa: BLE001 - no CUDA backend or ptxas in this Triton: nothing to match against
        return _done(KernelStatus("unavailable", f"kernels: prebuilt ones unusable here ({e}){_HINT}",
                                  counter=counter), logging.WARNING)
    found, unreadable = candidates(reader)
    chosen, decision, why = choose(found, want)
    if chosen is None:
        note = f" ({len(unreadable)} unreadable: {unreadable[0]})" if unreadable else ""
        level = logging.WARNING if decision != "none" else logging.INFO
        return _done(KernelStatus(decision, f"kernels: {why}{note}{_HINT}", counter=counter), level)
    ks, decision, how = load_trusted(reader, chosen.name)
    if ks is None:
        level = logging.ERROR if decision == "tampered" else logging.WARNING
        return _done(KernelStatus(decision, f"kernels: {how}{_HINT}", chosen.name, counter=counter), level)
    try:
        installed, stale = triton_cache.install(ks.kernels)
        launchers, lnote = _launchers(ks)
    except OSError as e:  # e.g. a read-only TRITON_CACHE_DIR: the kernels that did land are used, the rest compile
        return _done(KernelStatus("unavailable", f"kernels: Triton's cache cannot take them ({e}){_HINT}",
                                  chosen.name, counter=counter), logging.WARNING)
    if counter is not None:
        counter.verbose = True
    note = f"; {stale} from other kernel sources (another ft version) compile on first use" if stale else ""
    msg = (f"kernels: {installed} prebuilt for sm_{arch} (triton {ks.triton}, {how}) and {launchers} launchers "
           f"installed into Triton's cache{note}{lnote}; compiles since start are counted in the engine stats")
    return _done(KernelStatus("installed", msg, chosen.name, installed, stale, launchers, counter), logging.INFO)


def _launchers(ks: KernelSet) -> tuple[int, str]:
    """Install the entry's launchers where they are valid -> (count, note for the log line)."""
    if not ks.launchers:
        return 0, "; no launchers in the entry: Triton builds each on first launch (C compiler)"
    here = triton_cache.launcher_target()
    if (ks.python, ks.platform) != here:
        return 0, (f"; launchers built for {ks.python} on {ks.platform}, this process is {here[0]} on {here[1]}: "
                   f"Triton builds them on first launch")
    return triton_cache.install_launchers(ks.launchers), ""


def _done(status: KernelStatus, level: int) -> KernelStatus:
    log.log(level, "%s", status.message)
    return status
