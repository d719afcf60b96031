"""`ft plan`: writes a plan into the FTW and prints it, draws the report, shows a stored plan; `ft inspect` lists it
and `ft verify` checks it; bad input is refused before anything is written."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from ft.cli.main import app
from ft.formats import FtwReader
from ft.formats.plan import plan_names, read_plan

BUDGET = str(512 * 2**20 + 4 * 2**20)  # the default reserve (512 MiB) + room for the tiny model's parts


@pytest.fixture()
def ftw(ftw_for, tmp_path):
    return shutil.copytree(ftw_for("qwen3_moe", "nvfp4"), tmp_path / "m.ftw")


def _ft(*args: str):
    return CliRunner().invoke(app, list(args))


def test_plan_writes_prints_and_reports(ftw, tmp_path):
    res = _ft("plan", "--ftw", str(ftw), "--vram-budget", BUDGET, "--kv-reserve-tokens", "256", "--calibrate", "64",
              "--name", "laptop", "--report", str(tmp_path / "out"), "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "plan laptop (plans/laptop.json)" in res.stdout and "predicted: decode" in res.stdout
    assert "routing: calibration (64 tokens of built-in text on cpu)" in res.stdout
    p = read_plan(FtwReader(ftw), "laptop")
    assert p.vram.kv_tokens == 256 and p.routing.tokens == 64
    page = (tmp_path / "out" / "plan-laptop.html").read_text()
    svgs = [page[i:page.index("</svg>", i) + 6] for i in range(len(page)) if page.startswith("<svg", i)]
    assert len(svgs) >= 2 and all(ET.fromstring(s).tag.endswith("svg") for s in svgs)  # well-formed inline plots
    assert (tmp_path / "out" / "plan-laptop.txt").read_text().startswith("plan laptop")
    shown = _ft("plan", "--ftw", str(ftw), "--show", "laptop")
    assert shown.exit_code == 0 and shown.stdout == res.stdout
    inspect = _ft("inspect", str(ftw), "--json")
    assert json.loads(inspect.stdout)["placement_plans"][0]["name"] == "laptop"
    wide = CliRunner().invoke(app, ["inspect", str(ftw)], env={"COLUMNS": "400"}).stdout
    assert "laptop: cpu, VRAM budget 0.50 GiB" in wide and "routing calibration; predicted decode" in wide
    assert _ft("verify", str(ftw)).exit_code == 0


def test_default_name_and_uniform_prior(ftw):
    res = _ft("plan", "--ftw", str(ftw), "--vram-budget", BUDGET, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert plan_names(FtwReader(ftw)) == ["cpu-0.5gib"]
    assert "routing: uniform (no --routing or --calibrate" in res.stdout
    lane_off = _ft("plan", "--ftw", str(ftw), "--vram-budget", BUDGET, "--device", "cpu", "--no-cpu-lane",
                   "--name", "no-lane")
    assert lane_off.exit_code == 0, lane_off.output
    assert read_plan(FtwReader(ftw), "no-lane").machine.cpu_lane is False  # as `ft serve --no-cpu-lane` will run


@pytest.mark.parametrize("args,code,words", [
    (("--routing", "r.json", "--calibrate", "8"), 2, "give --routing FILE or --calibrate N, not both"),
    (("--name", "../x"), 2, "--name '../x'"),
    (("--vram-budget", "lots"), 2, "--vram-budget: cannot read 'lots'"),
    (("--routing", "missing.json"), 1, "cannot read a routing-count file"),
    (("--vram-budget", "1MiB"), 1, "smaller than the fixed allocations"),
    (("--show", "nope"), 1, "no plan named 'nope'"),
])
def test_bad_input_is_refused_and_nothing_is_written(ftw, args, code, words):
    before = (ftw / "model.ftw").read_bytes()
    full = ["plan", "--ftw", str(ftw), "--device", "cpu", *args]
    if "--vram-budget" not in args:
        full += ["--vram-budget", BUDGET]
    res = _ft(*full)
    assert res.exit_code == code and words in res.output, res.output
    assert (ftw / "model.ftw").read_bytes() == before


def test_without_a_gpu_the_budget_is_needed(ftw):
    res = _ft("plan", "--ftw", str(ftw), "--device", "cpu")
    assert res.exit_code == 1 and "--vram-budget is needed" in res.output
