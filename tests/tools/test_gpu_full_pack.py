"""tools/gpu_full.py's packing of its output folder, so that a run with more files than the GPU machine hands back
still comes back whole."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_full  # noqa: E402


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_small_output_is_left_as_it_is(tmp_path):
    for name in ("gpu_full.json", "logs.txt", "routing-a.jsonl"):
        (tmp_path / name).write_text(name)
    before = _files(tmp_path)
    assert gpu_full.pack_for_return(tmp_path) == 0 and _files(tmp_path) == before


def test_more_files_than_come_back_are_packed_into_one_archive(tmp_path):
    (tmp_path / "gpu_full.json").write_text("{}")
    (tmp_path / "logs.txt").write_text("log")
    for i in range(4):
        (tmp_path / f"routing-{i}.jsonl").write_bytes(bytes([i]) * 100)
    for tool in ("coldstart-geom", "startup-geom/run-1"):
        (tmp_path / tool).mkdir(parents=True)
        for i in range(3):
            (tmp_path / tool / f"serve-{i}.log").write_text(f"{tool} {i}")
    before = _files(tmp_path)
    assert gpu_full.pack_for_return(tmp_path) == 10
    assert sorted(_files(tmp_path)) == ["gpu_full.json", "logs.txt", gpu_full.PACKED]
    assert not (tmp_path / "coldstart-geom").exists() and not (tmp_path / "startup-geom").exists()
    with tarfile.open(tmp_path / gpu_full.PACKED) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert got == {k: v for k, v in before.items() if k not in ("gpu_full.json", "logs.txt")}
    assert gpu_full.pack_for_return(tmp_path) == 0  # three files now: nothing more to do


def test_a_deadline_too_short_for_any_model_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A models run whose deadline cannot leave a model its minimum is refused at once with the minimum named, not
    run to its end with every model skipped (a GPU call spent for nothing)."""
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_full.py", "--out", str(out), "--stages", "models",
                                      "--deadline-s", str(gpu_full.MODEL_MIN_S)])
    with pytest.raises(SystemExit) as e:
        gpu_full.main()
    assert e.value.code == 2 and f"at least {gpu_full.MODEL_MIN_S + 30} s" in capsys.readouterr().err
    assert not out.exists()
