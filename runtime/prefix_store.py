"""The prefix cache on disk (`--prefix-cache-dir`): a restarted server resumes its agents' conversations without
prefilling them again.

    save(cache, directory, model_key)         # the directory brought up to date with the kept states
    load(cache, directory, model_key, new_state)   # at start: the newest ones that fit the KV budget, kept again

One file per kept state, `prefix-<sha256 of its tokens>.safetensors` (written to a temporary name, fsynced, renamed):
`tokens` int64 [n]; the state's rows at n (`SequenceState.rows`): per attention layer i, `kv.i.k` / `kv.i.v`
[n, kv heads, head dim]; per compressed layer (deepseek_v4), `cmp.i.kv` [n, hd] and its complete pooled entries
`cmp.i.entries` / `cmp.i.index_entries` [n // m, ...]; the parts valid at n only (`SequenceState.windows`): per
linear-attention layer `conv.i` / `rec.i`, per compressed layer `raw.i` / `index_raw.i`; and each snapshot at length
L as `snap.L.<part>`. Metadata: `model` (the FTW's manifest hash, the compute dtype: states of another model or dtype
are never loaded), `format` ("ft-prefix-1"). safetensors holds tensors and strings only (no code runs on load); a
file that is malformed or too large for the budget is skipped, named in the log and removed; another model's files
are skipped and left for it. `save` runs while the server is idle (after the kept states changed) and at shutdown:
it writes the states that have no file yet and removes this model's files of states no longer kept (taken by a
request, evicted), so the directory follows the cache and a server killed mid-session loses at most what changed
since it was last idle. A file's name is its tokens' digest, and a state's content is fixed by its tokens, so an
existing file is never rewritten.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ft.runtime.state import check_parts

log = logging.getLogger("ft.prefix")
FORMAT = "ft-prefix-1"


def model_key(ftw_path: Path, dtype: torch.dtype) -> str:
    """The FTW's index (header + manifest: every tensor's checksum) hashed, with the dtype states are kept in."""
    return hashlib.sha256((Path(ftw_path) / "model.ftw").read_bytes()).hexdigest()[:32] + f"-{dtype}".replace(
        "torch.", "")


def _name(tokens: np.ndarray) -> str:
    return f"prefix-{hashlib.sha256(tokens.astype(np.int64).tobytes()).hexdigest()[:32]}.safetensors"


def save(cache, directory: Path, key: str) -> int:
    """Bring `directory` up to date with the kept states of `cache` (a PrefixCache): write those without a file,
    remove this model's files of states no longer kept (other models' stay); returns the number written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keep = {_name(e.tokens): e for e in cache.entries}
    for old in directory.glob("prefix-*.safetensors"):
        if old.name not in keep and _model_of(old) == key:
            old.unlink()
    written = 0
    for name, e in keep.items():
        final = directory / name
        if final.exists():
            continue
        tensors = {"tokens": torch.from_numpy(e.tokens.astype(np.int64))}
        tensors |= {name: t.cpu() for name, t in e.parts().items()}
        for length, snap in e.snapshots.items():
            tensors |= {f"snap.{length}.{name}": t.cpu() for name, t in snap.items()}
        tmp = final.with_name(final.name + ".tmp")
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata={"model": key, "format": FORMAT})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        written += 1
    return written


def load(cache, directory: Path, key: str, new_state) -> int:
    """Keep again the states saved in `directory` for this model (newest first, while the cache takes them);
    `new_state(num_tokens)` makes an empty SequenceState. Returns the number loaded."""
    directory = Path(directory)
    files = sorted(directory.glob("prefix-*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    loaded = 0
    for path in files:
        try:
            entry = _read(path, key, new_state)
        except _OtherModel as e:  # left for the model it belongs to
            log.warning("prefix cache: skipped %s (%s)", path.name, e)
            continue
        except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as e:
            log.warning("prefix cache: skipped %s (%s)", path.name, e)
            path.unlink(missing_ok=True)
            continue
        if cache.put(*entry):  # its file stays: `save` keeps the files of kept states
            loaded += 1
    return loaded


class _OtherModel(ValueError):
    pass


def _model_of(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError):
        return None
    return meta.get("model") if meta.get("format") == FORMAT else None


def _read(path: Path, key: str, new_state):
    owner = _model_of(path)
    if owner is None:
        raise ValueError("not a readable prefix-cache file")
    if owner != key:
        raise _OtherModel("saved by another model or dtype")
    t = load_file(str(path))
    tokens = t.pop("tokens").tolist()
    n = len(tokens)
    state = new_state(n)
    snapshots: dict[int, dict] = {}
    for name in [k for k in t if k.startswith("snap.")]:
        _, length, part = name.split(".", 2)
        snapshots.setdefault(int(length), {})[part] = t.pop(name)
    live = state.rows(n) | state.windows()
    check_parts(t, live, "the saved state")
    for name, value in t.items():
        live[name].copy_(value)
    windows = state.windows()
    for length, snap in snapshots.items():
        if not 0 < length <= n:
            raise ValueError(f"its snapshot at {length} lies outside its {n} tokens")
        check_parts(snap, windows, f"its snapshot at {length}")
    state.length = n
    return tokens, state, snapshots
