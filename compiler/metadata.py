"""Everything in the FTW manifest besides tensors: tokenizer assets and special tokens, generation defaults,
provenance (with a sha256 of every source file, computed on a background thread while the weights stream)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ft.compiler.errors import CheckpointError
from ft.compiler.source import read_json_if_exists
from ft.formats import ModelConfig
from ft.formats.prefetch import advice_step, will_need

# metadata files read when present; each one read becomes part of provenance.files
META_FILES = ("config.json", "generation_config.json", "hf_quant_config.json", "model.safetensors.index.json",
              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "max_new_tokens")


def compiler_version() -> str:
    try:
        return f"ft {version('ft-moe')}"
    except PackageNotFoundError:
        return "ft unknown"


def _token(v) -> str | None:
    """tokenizer_config's special tokens are strings or AddedToken objects ({"content": ...})."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def tokenizer_assets(root: Path) -> tuple[dict, dict[str, bytes]]:
    """(manifest.tokenizer, {asset name: bytes}). tokenizer.json is required; the chat template comes from
    chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or named templates' "default")."""
    tj = root / "tokenizer.json"
    if not tj.is_file():
        raise CheckpointError(f"{root.name}: tokenizer.json is missing (ft needs the fast-tokenizer file)")
    data = tj.read_bytes()
    tc = read_json_if_exists(root, "tokenizer_config.json") or {}
    assets = {"tokenizer.json": data}
    template = None
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(tc.get("chat_template"), str):
        template = tc["chat_template"]
    elif isinstance(tc.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in tc["chat_template"] if isinstance(t, dict)}
        template = named.get("default")
    if template is not None:
        assets["chat_template.jinja"] = template.encode("utf-8")
    special = _special_tokens(tc, data)
    meta = {"file": "tokenizer.json", "chat_template": "chat_template.jinja" if template is not None else None,
            "bos_token": _token(tc.get("bos_token")), "eos_token": _token(tc.get("eos_token")),
            "pad_token": _token(tc.get("pad_token")), "special_tokens": special}
    return meta, assets


def _special_tokens(tc: dict, tokenizer_json: bytes) -> dict[str, int]:
    """{content: id} of the special added tokens: from tokenizer_config's added_tokens_decoder when present (small),
    else from tokenizer.json's added_tokens (a full parse of a file of tens of MB)."""
    dec = tc.get("added_tokens_decoder")
    if isinstance(dec, dict) and dec:
        entries = [dict(v, id=int(k)) for k, v in dec.items() if isinstance(v, dict) and str(k).isdigit()]
    else:
        try:
            entries = json.loads(tokenizer_json).get("added_tokens") or []
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"tokenizer.json: not valid JSON ({e})") from None
    special = {t["content"]: t["id"] for t in entries if isinstance(t, dict) and t.get("special")
               and isinstance(t.get("content"), str) and isinstance(t.get("id"), int)}
    return dict(sorted(special.items(), key=lambda kv: kv[1]))


def generation_defaults(gen: dict | None, cfg: ModelConfig) -> dict:
    out = {k: gen[k] for k in GENERATION_KEYS if gen and gen.get(k) is not None}
    out["eos_token_ids"] = list(cfg.eos_token_ids)
    return out


def source_files(root: Path, weight_files: list[str]) -> list[str]:
    """Every file the compile reads, as names relative to the checkpoint root (weights in first-use order)."""
    return [f for f in META_FILES if (root / f).is_file()] + list(weight_files)


class Hasher(threading.Thread):
    """sha256 of each file, on a background thread while the compile streams (hashlib and file reads release the
    GIL). Weight files come in index order, which is roughly the order the compile reads them, so one of the two
    readers mostly finds the other's pages in the page cache."""

    def __init__(self, root: Path, names: list[str]) -> None:
        super().__init__(name="ft-sha256", daemon=True)
        self.root, self.names = root, names
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        self._cancel = threading.Event()

    def run(self) -> None:
        try:
            for name in self.names:
                digest = self._hash(self.root / name)
                if digest is None:
                    return
                self.digests[name] = digest
        except BaseException as e:  # re-raised on the main thread by result()
            self.error = e

    def _hash(self, path: Path, chunk: int = 16 << 20, ahead: int = 4) -> str | None:
        """sha256 of one file; the kernel is asked to read `ahead` chunks in advance so that disk reads overlap the
        hashing instead of alternating with it."""
        h, buf = hashlib.sha256(), bytearray(chunk)
        view = memoryview(buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            size, pos, advised = os.fstat(fd).st_size, 0, 0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            step = advice_step(fd)
            while pos < size:
                if self._cancel.is_set():
                    return None
                while advised < min(size, pos + ahead * chunk):
                    will_need(fd, advised, chunk, step)
                    advised += chunk
                n = os.preadv(fd, [view], pos)
                if n <= 0:
                    raise OSError(f"{path.name}: unexpected end of file at {pos} of {size} bytes")
                h.update(view[:n])
                pos += n
        finally:
            os.close(fd)
        return h.hexdigest()

    def result(self) -> dict[str, str]:
        self.join()
        if self.error is not None:
            raise CheckpointError(f"cannot hash source files: {self.error}") from self.error
        return dict(sorted(self.digests.items()))

    def stop(self) -> None:
        """End early (the compile failed); a no-op once finished."""
        self._cancel.set()
        self.join()


def published_sha256(root: Path, name: str) -> str | None:
    """The sha256 the Hugging Face Hub publishes for source file `name` (its LFS object id), where the download
    recorded it and the file is still what was downloaded; None otherwise (the caller hashes the file):
    * a hub cache snapshot: the file is a link to `blobs/<sha256>` (LFS files; git files are named by sha1);
    * a `hf download --local-dir` folder: `.cache/huggingface/download/<name>.metadata` (commit, etag, timestamp)
      with a sha256 etag, the file not modified after that timestamp (huggingface_hub's own rule, 1 s of slack).
    Provenance identifies the source by the digests hubs publish (specs/ftw.md §9); these are those digests."""
    path = root / name
    try:
        if path.is_symlink():
            target = Path(os.readlink(path))
            digest = target.name
            return digest if target.parent.name == "blobs" and _is_sha256(digest) else None
        meta = root / ".cache" / "huggingface" / "download" / f"{name}.metadata"
        if not meta.is_file():
            return None
        lines = meta.read_text().splitlines()
        etag, stamp = lines[1].strip(), float(lines[2])
        return etag if _is_sha256(etag) and path.stat().st_mtime - 1 <= stamp else None
    except (OSError, ValueError, IndexError):  # unreadable or malformed: hash the file
        return None


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def provenance(source: str, revision: str | None, digests: dict[str, str]) -> dict:
    return {"source": source, "revision": revision, "files": digests, "compiler": compiler_version()}


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
