"""What Triton's on-disk kernel cache needs from us: the key parts a prebuilt kernel must share with this process, the
runtime's kernel functions and their source keys, installing kernels into the cache, and counting compiles.

Triton files a compiled kernel under sha256(triton_key - source hash - backend hash - options hash - env) (triton
3.6/3.9 `compiler.compile`, `runtime.cache.get_cache_key`), and `compile` returns the cached kernel without compiling
when its group file names a `.json` metadata file. Every part is content, not a path: `triton_key()` hashes the
installed Triton (its Python files and libtriton, so one Triton version on another Python or platform is another
build), the backend hash is ptxas' version and the arch, the options hash holds libdevice's digest, and the env part
lists only the cache-invalidating variables that are set. The source hash comes from the kernel's source (and its
callees'), the specialization (dtypes, 16-byte alignment, divisibility of integers) and the constexprs. So a kernel
compiled on any machine by the same Triton build for the same arch, from the same source and launch, has the key a
launch here computes, and installing its files under that key makes the launch load it without compiling.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import threading

log = logging.getLogger("ft.gpu")

# ft.runtime.gpu modules whose kernels the runtime launches (`kernel_function` resolves names only inside these).
KERNEL_MODULES = ("cpu.lane", *(f"kernels.{m}" for m in (
    "decode_attention", "deltanet_decode", "deltanet_prefill", "dense_dequant", "dense_gemv", "dense_quant",
    "dense_quant_mma", "embedding", "fused_ops", "gather", "nvfp4_decode", "nvfp4_decode_mma", "nvfp4_triton",
    "router")))


def target_key(arch: int) -> dict:
    """The parts of Triton's cache key that a prebuilt kernel must share with this process for target sm_`arch`:
    {"triton", "triton_build", "arch", "backend_key", "env"} (see the module docstring)."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    backend = make_backend(GPUTarget("cuda", arch, 32))
    return {"triton": triton.__version__, "triton_build": hashlib.sha256(triton_key().encode()).hexdigest(),
            "arch": arch, "backend_key": hashlib.sha256(backend.hash().encode()).hexdigest(),
            "env": dict(sorted(get_cache_invalidating_env_vars().items()))}


def kernel_function(qualname: str):
    """The JITFunction named `ft.runtime.gpu.<a KERNEL_MODULES entry>.<name>`, or None where there is no such kernel
    here (only the modules of KERNEL_MODULES are imported: the name comes from a file)."""
    from triton.runtime.jit import JITFunction

    prefix, _, name = qualname.rpartition(".")
    module = prefix.removeprefix("ft.runtime.gpu.")
    if not prefix.startswith("ft.runtime.gpu.") or module not in KERNEL_MODULES:
        return None
    fn = getattr(importlib.import_module(prefix), name, None)
    return fn if isinstance(fn, JITFunction) else None


def source_key(fn) -> str:
    """The function's part of Triton's source hash: its source, its callees' and the global constants it reads.
    Computed after `settle_source_keys` (call it first), so that it is the same in every process."""
    return fn.cache_key


def settle_source_keys() -> int:
    """Compute the source keys of the runtime's kernels and of every JIT function they call, callees first, so that
    each key is the same whatever the process did before -> how many functions were keyed.

    Triton 3.6 folds a callee's global constants into a caller's key only when the callee's key was computed before
    the caller's (`DependenciesFinder._update_hash` merges `used_global_vals` before it computes the callee's key), so
    a key depended on the order in which a process first launched or hashed its kernels: the build launched
    `_gate_up_mma_kernel` before `_down_mma_kernel`, the runtime hashed them in name order, and their keys for the
    latter differed. Keys already computed are dropped and recomputed in this order (no kernel has been launched
    when this runs: build start, engine start)."""
    order: list = []
    for module in KERNEL_MODULES:
        m = importlib.import_module(f"ft.runtime.gpu.{module}")
        for value in list(vars(m).values()):
            _post_order(value, order, set())
    for fn in order:
        fn.hash = None
    for fn in order:
        _ = fn.cache_key
    return len(order)


def _post_order(fn, order: list, visiting: set) -> None:
    """Append `fn` (a JIT function) after the JIT functions it references by name (`f(...)`, `module.f(...)`)."""
    import ast

    from triton.runtime.jit import JITCallable

    if not isinstance(fn, JITCallable) or id(fn) in visiting or any(f is fn for f in order):
        return
    visiting.add(id(fn))
    scope = dict(fn.__globals__)
    for node in ast.walk(fn.parse()):
        target = None
        if isinstance(node, ast.Name):
            target = scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = getattr(scope.get(node.value.id), node.attr, None)
        if isinstance(target, JITCallable):
            _post_order(target, order, visiting)
    order.append(fn)


def install(kernels) -> tuple[int, int]:
    """Put each `formats.kernels.Kernel` into Triton's cache (the configured cache manager, `TRITON_CACHE_DIR` or
    ~/.triton/cache) unless an entry is there already. Kernels whose function is gone or whose source key differs
    from this runtime's are skipped: their launches compile. -> (installed or already there, skipped)."""
    from triton.runtime.cache import get_cache_manager

    settle_source_keys()
    ready = stale = 0
    for k in kernels:
        fn = kernel_function(k.function)
        if fn is None or source_key(fn) != k.source:
            stale += 1
            continue
        cache = get_cache_manager(k.hash)
        meta = f"{k.name}.json"
        group = cache.get_group(meta) or {}
        if set(k.files) - set(group):
            paths = {fname: cache.put(data, fname, binary=True) for fname, data in k.files.items()}
            cache.put_group(meta, paths)
        ready += 1
    return ready, stale


def launcher_target() -> tuple[str, str]:
    """(extension suffix, Triton's platform key) of this process: where a prebuilt launcher module is valid."""
    import sysconfig

    from triton.runtime.build import platform_key

    return sysconfig.get_config_var("EXT_SUFFIX"), platform_key()


def install_launchers(launchers) -> int:
    """Put each `formats.kernels.Launcher` (built for this process' `launcher_target`: the caller checked) into
    Triton's cache as `<name><suffix>` under its key, unless a file is there already -> how many are there now.
    Triton finds one when a launch's C source and platform give its key; it builds (and logs) any other."""
    from triton.runtime.cache import get_cache_manager

    suffix, _ = launcher_target()
    for m in launchers:
        cache = get_cache_manager(m.key)
        fname = f"{m.name}{suffix}"
        if cache.get_file(fname) is None:
            cache.put(m.data, fname, binary=True)
    return len(launchers)


class CompileCounter:
    """Counts the kernels Triton compiles in this process (cache misses), through `triton.knobs.compilation.listener`
    (chained after any listener already set). `names`: the last ones compiled, with their constexprs."""

    _installed: "CompileCounter | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.compiled = 0
        self.hits = 0
        self.names: list[str] = []
        self.verbose = False  # log each compile at INFO (prebuilt kernels were installed: a compile is a miss)

    @classmethod
    def get(cls) -> "CompileCounter | None":
        """The process' counter, installed on first use; None where this Triton has no compilation listener."""
        with cls._lock:
            if cls._installed is None:
                from triton import knobs

                if not hasattr(knobs.compilation, "listener"):
                    return None
                counter, before = cls(), knobs.compilation.listener

                def listener(*, src, metadata, metadata_group, times, cache_hit):
                    counter.observe(src, cache_hit)
                    if before is not None:
                        before(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                               cache_hit=cache_hit)

                knobs.compilation.listener = listener
                cls._installed = counter
            return cls._installed

    def observe(self, src, cache_hit: bool) -> None:
        if cache_hit:
            self.hits += 1
            return
        self.compiled += 1
        fn = getattr(src, "fn", None)
        args = getattr(fn, "arg_names", [])
        consts = {(args[k[0]] if isinstance(k, tuple) and len(k) == 1 and k[0] < len(args) else k): v
                  for k, v in (getattr(src, "constants", {}) or {}).items()}  # (index,) -> the argument's name
        shown = ", ".join(f"{k}={v}" for k, v in consts.items() if not callable(v))
        name = f"{getattr(fn, '__name__', getattr(src, 'name', '?'))}" + (f"[{shown}]" if shown else "")
        self.names = (self.names + [name])[-64:]
        (log.info if self.verbose else log.debug)("kernels: compiled %s (not prebuilt)", name)
