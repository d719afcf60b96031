"""tools/gpu_bench.py on the CPU: `--plan full` expands to the GPU issue's whole matrix, explicit flags win, and the
time plan skips (and says why) what would overrun the deadline. No GPU involved."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_bench  # noqa: E402
from gpu_bench_plan import TimePlan, estimate  # noqa: E402


def test_full_plan_is_the_issue_matrix():
    a = gpu_bench.parse_args(["--out", "o", "--plan", "full"])
    assert a.routings.split(",") == ["uniform", "skewed"]
    assert a.budgets == [8, 12, 24] and a.prefill_lengths == [2048, 16384, 32768]
    assert (a.prompt, a.tokens) == (2048, 512)  # decode: 512 tokens after a 2k prompt
    assert {"profile", "e2e", "bw", "tests"} <= set(a.stages.split(",")) and a.profile_trace
    assert a.prefill_budgets == [8]  # defaults to the first budget


def test_explicit_flags_override_the_plan():
    a = gpu_bench.parse_args(["--out", "o", "--plan", "full", "--tokens", "64", "--routings", "skewed"])
    assert (a.tokens, a.routings, a.prompt) == (64, "skewed", 2048)
    assert gpu_bench.parse_args(["--out", "o"]).tokens == 64 and gpu_bench.parse_args(["--out", "o"]).plan == ""


def test_unknown_plan_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--out", "o", "--plan", "huge"])
    assert "unknown plan 'huge'" in capsys.readouterr().err


def test_time_plan_skips_what_would_overrun_and_records_why():
    now = [1000.0]
    plan = TimePlan(deadline=1100.0, clock=lambda: now[0])
    assert plan.admit("env", 5)
    now[0] = 1060.0
    assert not plan.admit("bw", 45)
    assert plan.skipped == {"bw": "estimated 45 s, 40 s left before the deadline"}
    assert plan.admit("kernel", 40) and plan.estimates == {"env": 5, "bw": 45, "kernel": 40}


def test_estimates_grow_with_the_work_and_builds():
    a = gpu_bench.parse_args(["--out", "o", "--plan", "full"])
    built = frozenset({"uniform", "skewed"})
    small = gpu_bench.parse_args(["--out", "o", "--plan", "full", "--tokens", "64", "--prefill-lengths", "2048"])
    assert estimate("e2e", small, built) < estimate("e2e", a, built) < estimate("e2e", a, frozenset())
    # The matrix's measurements (profile + e2e after the quick stages) are planned to fit in its own deadline.
    assert sum(estimate(s, a, built) for s in ("env", "tests", "pin", "profile", "e2e")) < a.deadline_s
