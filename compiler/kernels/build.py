"""`ft kernels build`: compile the runtime's Triton kernels for an FTW's model and GPU architectures, on any machine
(no GPU needed: Triton's wheel ships ptxas), and store them as `kernels/` entries of the FTW (specs/ftw.md §5.7).

    added = add_kernels(ftw_dir, archs=[90, 120])   # one container per arch; trusted on this machine

Per arch: the model's launches (`launches.GROUPS`) replayed inside `stand_in.cuda_target`, every distinct compiled
kernel read back from Triton's temporary cache, packed with the key parts the runtime matches (`formats.kernels`),
with the host launchers Triton would build for them at their first launch (`launchers.py`; skipped with a warning
where this machine has no C compiler or Python headers, or this Triton nothing to prebuild).
The FTW's previous entry for the same Triton build and arch is replaced; entries for other Triton builds are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ft.formats import FtwReader, kernel_trust
from ft.formats.kernels import Kernel, KernelSet, entry_name, pack
from ft.formats.slots import update_slot

from . import launches
from .launchers import LauncherBuilder
from .stand_in import cuda_target

DEFAULT_ARCHS = (80, 86, 89, 90, 100, 120)
MAX_PREFILL = 4096  # the engine's largest default prefill chunk (runtime.gpu.sizing.OFFLOADED_PREFILL_CHUNK)
LOCAL = "built on this machine (ft kernels build)"


@dataclass
class ArchResult:
    arch: int
    entry: str
    kernels: int
    nbytes: int
    errors: list[str] = field(default_factory=list)
    launchers: int = 0
    launchers_skipped: str | None = None  # why no launchers were built, or None


def parse_archs(text: str) -> list[int]:
    """"80,86,sm_90" -> [80, 86, 90]; refuses anything else loudly."""
    out = []
    for part in text.split(","):
        p = part.strip().lower().removeprefix("sm_").removeprefix("sm")
        if not p.isdigit() or not 50 <= int(p) <= 1000:
            raise ValueError(f"{part.strip()!r} is not a CUDA architecture (e.g. 80, 86, 89, 90, 100, 120)")
        out.append(int(p))
    return sorted(set(out))


def build_kernel_set(reader: FtwReader, arch: int, *, groups: list[str] | None = None,
                     max_prefill: int = MAX_PREFILL, on_event: Callable[[str], None] | None = None,
                     launchers: LauncherBuilder | None = None) -> tuple[KernelSet, list[str]]:
    """Compile the model's kernels for sm_`arch` -> (kernel set, build errors). `on_event(text)`: progress.
    `launchers`: also build the kernels' host launchers (kept in the builder across archs: one per signature)."""
    other = sorted(set(reader.config.layer_types) - {"full_attention", "sliding_attention", "linear_attention"})
    if other:  # their layers run as PyTorch ops; the launch replay (`launches.py`) covers the kernel layers only
        raise ValueError(f"{reader.path}: family {reader.config.family} has no prebuilt GPU kernels yet (its "
                         f"{', '.join(other)} layers' launches are not replayed; the runtime compiles its expert "
                         "kernels at first use)")
    from triton.runtime.cache import get_cache_manager

    from ft.runtime.gpu.triton_cache import kernel_function, source_key, target_key

    say = on_event or (lambda text: None)
    names = groups or list(launches.GROUPS)
    unknown = set(names) - set(launches.GROUPS)
    if unknown:
        raise ValueError(f"unknown kernel groups {sorted(unknown)}; known: {', '.join(launches.GROUPS)}")
    g, lengths = launches.geometry(reader), launches.prefill_lengths(max_prefill)
    errors: list[str] = []
    kernels: list[Kernel] = []
    with cuda_target(arch, on_kernel=lambda b: say(f"sm_{arch} {b.case}: {b.name}")) as rec:
        for name in names:
            rec.case = name
            say(f"sm_{arch} {name}")
            try:
                launches.GROUPS[name](g, lengths)
            except Exception as e:  # noqa: BLE001 - a launcher failing on the host: reported, the others go on
                errors.append(f"{name} launcher: {type(e).__name__}: {e}"[:600])
        errors += list(rec.errors.values())
        for b in rec.built.values():
            group = get_cache_manager(b.hash).get_group(f"{b.name}.json") or {}
            files = {}
            for ext in ("json", "cubin"):
                fname = f"{b.name}.{ext}"
                if fname not in group:
                    raise RuntimeError(f"Triton's cache holds no {fname} for kernel {b.hash[:12]}")
                files[fname] = Path(group[fname]).read_bytes()
            fn = kernel_function(b.function)
            kernels.append(Kernel(b.hash, b.name, b.function, source_key(fn), files))
    mods = ()
    if launchers is not None:
        say(f"sm_{arch} launchers")
        launchers.add_utils()
        for b in rec.built.values():
            launchers.add(b.kernel)
        errors += launchers.errors
        launchers.errors = []
        mods = tuple(launchers.launchers.values())
    key = target_key(arch)
    ks = KernelSet(triton=key["triton"], triton_build=key["triton_build"], arch=arch, backend_key=key["backend_key"],
                   kernels=tuple(kernels), env=key["env"], launchers=mods,
                   python=launchers.python if mods else "", platform=launchers.platform if mods else "")
    return ks, errors


def add_kernels(ftw: Path, archs: list[int], *, groups: list[str] | None = None, max_prefill: int = MAX_PREFILL,
                on_event: Callable[[str], None] | None = None) -> list[ArchResult]:
    """Build for every arch, then add the containers to the FTW in one index rewrite (replacing this Triton build's
    previous entries for those archs) and trust them on this machine."""
    from ft.runtime.gpu.prebuilt import candidates

    reader = FtwReader(ftw, checksums="off")
    results, add, digests, builds = [], {}, [], set()
    skipped = LauncherBuilder.why_not()
    lb = None if skipped else LauncherBuilder.for_this_triton()
    try:
        for arch in archs:
            ks, errors = build_kernel_set(reader, arch, groups=groups, max_prefill=max_prefill, on_event=on_event,
                                          launchers=lb)
            data = pack(ks)
            name = entry_name(ks, data)
            add[name] = data
            digests.append(kernel_trust.digest(data))
            builds.add((arch, ks.triton_build))
            results.append(ArchResult(arch, f"kernels/{name}", len(ks.kernels), len(data), errors,
                                      len(ks.launchers), skipped))
    finally:
        if lb is not None:
            lb.close()
    found, _ = candidates(reader)
    remove = {c.name for c in found if (c.arch, c.triton_build) in builds} - {r.entry for r in results}
    for d in digests:  # trusted before the index lists them: a server starting meanwhile finds them trusted
        kernel_trust.trust(d, LOCAL)
    update_slot(Path(ftw), "kernels", add, remove)
    return results
