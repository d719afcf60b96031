"""Compiled models on the Hugging Face Hub: `ft bundle push DIR REPO_ID`, `ft bundle pull REPO_ID --out DIR`, and
`--ftw REPO_ID` wherever an FTW directory is expected.

The FTW directory is pushed as it is (`upload_folder`: large files go through the Hub's LFS/Xet storage, uploads
resume), and pulled with `snapshot_download` into the Hub cache (HF_HOME / HF_HUB_CACHE, HF_TOKEN, revisions,
resumed downloads and HF_HUB_OFFLINE are huggingface_hub's), so a pulled model is shared by every tool that uses the
cache. A pulled snapshot must hold `model.ftw`; its structure is validated on arrival (every rule of `ft verify` but
the full checksum pass, which the reader then does lazily per record, or `ft verify` in full).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class HubError(ValueError):
    """A repo id that is not one, a repo without an FTW, or a failed transfer."""


def resolve_ftw(ref: str | Path, *, revision: str | None = None) -> Path:
    """A local FTW directory as is; a repo id (org/name) pulled into the Hub cache. Raises HubError otherwise."""
    p = Path(ref)
    if p.is_dir():
        if revision is not None:
            raise HubError(f"--revision applies to Hub repo ids; {ref} is a local directory")
        return p
    if p.exists():
        raise HubError(f"{ref}: not a directory (pass an FTW directory or a repo id like org/name)")
    if not REPO_ID.match(str(ref)):
        raise HubError(f"{ref!r}: no such directory, and not a Hugging Face repo id (org/name)")
    return pull(str(ref), revision=revision)


def pull(repo_id: str, *, revision: str | None = None, out: Path | None = None) -> Path:
    """Download (or find in the cache) a pushed FTW; `out`: a new directory to copy it to as well."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    from .reader import FtwReader

    try:
        path = Path(snapshot_download(repo_id, revision=revision))
    except (RepositoryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError) as e:
        raise HubError(f"{repo_id}: could not fetch it from the Hub ({type(e).__name__}: "
                       f"{str(e).splitlines()[0]})") from None
    if not (path / "model.ftw").is_file():
        raise HubError(f"{repo_id}: the repo holds no model.ftw; push an FTW written by `ft checkpoint`")
    FtwReader(path, checksums="lazy")  # structure validated now; every record's checksum on first use
    if out is None:
        return path
    if Path(out).exists():
        raise HubError(f"{out} exists; pull into a new directory")
    shutil.copytree(path, out)  # the cache's links resolved: a plain directory of its own
    return Path(out)


def push(src: Path, repo_id: str, *, revision: str | None = None, private: bool = False) -> str:
    """Upload an FTW directory to a model repo (created if missing); returns the commit URL."""
    from huggingface_hub import HfApi

    from .bundle_safety import source_files

    if not REPO_ID.match(repo_id):
        raise HubError(f"{repo_id!r} is not a Hugging Face repo id (org/name)")
    source_files(Path(src))  # an FTW of regular files only (no links that would upload what they point to)
    api = HfApi()
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=str(src), repo_id=repo_id, revision=revision,
                             commit_message=f"ft bundle push {Path(src).name}",
                             ignore_patterns=["*.part", "*.tmp", ".ft-verified"])
    return str(info)
