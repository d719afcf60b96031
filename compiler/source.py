"""Locate a Hugging Face checkpoint (local directory or hub repo id) and index its tensors.

A repo id is fetched with `huggingface_hub.snapshot_download` into its cache (HF_HOME / HF_HUB_CACHE respected,
resume and HF_HUB_OFFLINE handled by huggingface_hub) in two steps: first the small metadata files (config,
tokenizer, index), so an unsupported model is refused before any weight is downloaded, then exactly the weight files
the index names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ft.compiler.errors import CheckpointError
from ft.compiler.safetensors_io import TensorInfo, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# metadata files we read when present (tokenizer, chat template, generation defaults, quant config)
META_PATTERNS = ["*.json", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Located:
    root: Path
    source: str  # repo id, or the directory's base name (never an absolute path)
    revision: str | None  # resolved commit for hub snapshots


def locate(model: str, revision: str | None = None) -> Located:
    """A local directory as is; a repo id through the huggingface_hub cache (downloading what is missing)."""
    p = Path(model).expanduser()
    if p.is_dir():
        if revision is not None:
            raise CheckpointError(f"--revision applies to hub repo ids; {model!r} is a local directory")
        return Located(p.resolve(), p.resolve().name, None)
    if p.exists():
        raise CheckpointError(f"{model}: not a directory (pass the checkpoint directory or a repo id like org/name)")
    if not _REPO_ID.match(model):
        raise CheckpointError(f"{model!r}: no such directory, and not a Hugging Face repo id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    def fetch(patterns: list[str]) -> Path:
        try:
            return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
        except HFValidationError as e:
            raise CheckpointError(f"{model!r}: invalid repo id or revision: {e}") from None
        except Exception as e:  # network, auth, offline cache miss: huggingface_hub's own words
            raise CheckpointError(f"{model}: cannot fetch from the Hugging Face hub: {type(e).__name__}: {e}") from None

    root = fetch(META_PATTERNS)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{model}: the repo has no config.json; refusing to fetch weights without a config")
    from ft.compiler.families import family_for  # refuse unsupported architectures before the big download

    family_for(json.loads((root / "config.json").read_text()), "config.json")
    weights = sorted(set(_read_json(root / INDEX)["weight_map"].values())) if (root / INDEX).is_file() else [SINGLE]
    root = fetch(META_PATTERNS + weights)
    return Located(root, model, root.name)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name}: expected a JSON object")
    return data


def read_json_if_exists(root: Path, name: str) -> dict | None:
    return _read_json(root / name) if (root / name).is_file() else None


@dataclass
class Checkpoint:
    """The tensors of one checkpoint: name -> where it lives, across shards."""

    root: Path
    config: dict
    weight_files: list[str]  # relative names, in index order
    tensors: dict[str, TensorInfo] = field(repr=False)

    @classmethod
    def open(cls, root: Path, on_files: Callable[[dict, list[str], dict | None], None] | None = None) -> Checkpoint:
        """Index the checkpoint; `on_files(config, weight files, weight_map or None)` is called once the weight files
        are known, before their headers are read (the compiler starts reading the weights then)."""
        config = _read_json(root / "config.json")
        if (root / INDEX).is_file():
            index = _read_json(root / INDEX)
            wmap = index.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise CheckpointError(f"{INDEX}: no 'weight_map'")
            files = list(dict.fromkeys(wmap.values()))
            missing = [f for f in files if not (root / f).is_file()]
            if missing:
                raise CheckpointError(f"{INDEX} names shard(s) that are missing: {', '.join(missing)}")
        elif (root / SINGLE).is_file():
            wmap, files = None, [SINGLE]
        else:
            found = sorted(p.name for p in root.glob("*.safetensors"))
            hint = f" (found {', '.join(found[:3])} without {INDEX})" if found else ""
            raise CheckpointError(f"{root.name}: no {SINGLE} and no {INDEX}{hint}")
        if on_files is not None:
            on_files(config, files, wmap)
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(root / f).items():
                if wmap is not None and wmap.get(name) != f:
                    continue  # the index is authoritative; a stray duplicate in another shard is ignored
                tensors[name] = info
        if wmap is not None:
            absent = [n for n in wmap if n not in tensors]
            if absent:
                raise CheckpointError(f"{wmap[absent[0]]}: tensor {absent[0]!r} listed in {INDEX} is not in the file"
                                      + (f" ({len(absent) - 1} more missing)" if len(absent) > 1 else ""))
        return cls(root, config, files, tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def float_dtype(self, name: str) -> torch.dtype:
        """The dtype of a tensor that must be a plain float (norms, embeddings, routers, biases, fused experts)."""
        info = self.info(name)
        if info.dtype not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{name}: dtype {info.dtype} is not supported here; supported: F32, F16, BF16")
        return info.torch_dtype

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.root.name}: tensor {name!r} not found in the checkpoint") from None
