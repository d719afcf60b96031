"""Compiled models on the Hugging Face Hub (`ft.formats.hub`): a pushed FTW is served by repo id from the Hub cache
(offline here: a pre-populated cache with HF_HUB_OFFLINE=1), and what is not an FTW is refused clearly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ft.formats import hub

CLI = [sys.executable, "-c", "from ft.cli.main import main; main()"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def cache(ftw_for, tmp_path) -> dict:
    """A Hub cache holding someorg/tiny-ftw (an FTW) and someorg/not-ftw (no model.ftw); the env that uses it."""
    for name, src in (("tiny-ftw", ftw_for("qwen3_moe", "none")), ("not-ftw", None)):
        repo = tmp_path / "hub" / f"models--someorg--{name}"
        snap = repo / "snapshots" / COMMIT
        if src is not None:
            shutil.copytree(src, snap)
        else:
            snap.mkdir(parents=True)
            (snap / "README.md").write_text("weights elsewhere")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_HUB_OFFLINE": "1"}


def _ft(args, env):
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_pushed_ftw_is_used_by_repo_id_from_the_cache(cache, tmp_path):
    res = _ft(["bundle", "pull", "someorg/tiny-ftw", "--out", str(tmp_path / "copy")], cache)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "copy" / "model.ftw").is_file()
    res = _ft(["generate", "--ftw", "someorg/tiny-ftw", "--token-ids", "1,2,3", "--max-tokens", "2", "--json"], cache)
    assert res.returncode == 0, res.stderr
    res = _ft(["bundle", "pull", "someorg/not-ftw"], cache)
    assert res.returncode == 1 and "no model.ftw" in res.stderr
    res = _ft(["bundle", "pull", "someorg/absent"], cache)
    assert res.returncode == 1 and "could not fetch" in res.stderr and "Traceback" not in res.stderr


def test_local_paths_and_repo_ids_are_told_apart(tmp_path, ftw_for):
    ftw = ftw_for("qwen3_moe", "none")
    assert hub.resolve_ftw(ftw) == ftw
    with pytest.raises(hub.HubError, match="local directory"):
        hub.resolve_ftw(ftw, revision="main")
    with pytest.raises(hub.HubError, match="not a Hugging Face repo id"):
        hub.resolve_ftw(tmp_path / "missing" / "deeper" / "x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(hub.HubError, match="not a directory"):
        hub.resolve_ftw(tmp_path / "file")


def test_push_uploads_the_ftw_folder(ftw_for, monkeypatch):
    calls = []

    class Api:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def create_branch(self, repo_id, **kw):
            calls.append(("create_branch", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            return "https://hub/commit/1"

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    ftw = ftw_for("qwen3_moe", "none")
    assert hub.push(ftw, "me/model", revision="v1") == "https://hub/commit/1"
    assert [c[0] for c in calls] == ["create_repo", "create_branch", "upload_folder"]
    up = calls[-1][1]
    assert up["folder_path"] == str(ftw) and up["repo_id"] == "me/model" and up["revision"] == "v1"
    with pytest.raises(hub.HubError, match="repo id"):
        hub.push(ftw, "not a repo")
