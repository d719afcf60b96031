"""The prefix cache's host tier (`--prefix-cache-host-memory`): a kept state that the KV budget pushes out moves to
host memory and still serves its conversation, copied back instead of prefilled; the tier drops its least recently
used states when full, and its states are written to --prefix-cache-dir like the others."""

from __future__ import annotations

import pytest

from prefix_lib import ARCHS, FIRST, engine, same, turn

OTHER = [(5 * i + 1) % 170 + 9 for i in range(30)]  # a second conversation sharing no token with FIRST
BUDGET = dict(kv_reserve_tokens=64)  # one conversation (36 tokens) kept beside one running request (~40), not two


def _alternate(eng, plain):
    """Conversation A, then B (whose admission pushes A's kept state out of the KV budget), then A's next turn: its
    greedy output compared with an engine without the cache. Returns A's first reply and the tokens the next turn
    took from the cache."""
    first, _ = turn(eng, FIRST, "a1")
    turn(eng, OTHER, "b1")
    second = FIRST + first + [17, 23, 29, 31]
    got, hit = turn(eng, second, "a2")
    assert got == turn(plain, second, "a2")[0] and same(eng, plain)
    return first, hit


@pytest.mark.parametrize("arch", ARCHS)
def test_a_state_pushed_out_of_the_kv_budget_resumes_from_host_memory(ftw_for, arch):
    ftw = ftw_for(arch, "none")
    eng, plain = engine(ftw, 4, prefix_cache_host_memory="64MiB", **BUDGET), engine(ftw, 0, **BUDGET)
    first, hit = _alternate(eng, plain)
    assert len(FIRST) + len(first) - 1 <= hit <= len(FIRST) + len(first)  # the whole conversation, not re-prefilled
    stats = eng.stats()
    c = stats["prefix_cache"]
    assert c["spilled"] >= 2 and c["restored"] == 1 and c["evicted"] == 0  # A out, then B out when A came back
    assert c["host_entries"] >= 1 and 0 < c["host_bytes"] <= 64 << 20
    assert eng.kv.used == stats["kv_tokens_cached"] <= eng.kv.total  # host entries hold no KV


def test_without_a_host_tier_the_pushed_out_state_is_dropped(ftw_for):
    ftw = ftw_for("qwen3_moe", "none")
    eng, plain = engine(ftw, 4, prefix_cache_host_memory="0", **BUDGET), engine(ftw, 0, **BUDGET)
    _, hit = _alternate(eng, plain)
    c = eng.stats()["prefix_cache"]
    assert hit == 0 and c["spilled"] == 0 and c["evicted"] >= 1 and c["host_entries"] == 0


def test_a_full_host_tier_drops_its_least_recently_used_state(ftw_for):
    """Room in host memory for one conversation: B pushed out after A drops A from the tier, so A's next turn is
    prefilled again, while B's next turn still resumes from host memory."""
    ftw = ftw_for("qwen3_moe", "none")
    probe = engine(ftw, 4, prefix_cache_host_memory="64MiB", **BUDGET)
    turn(probe, FIRST, "a1")
    turn(probe, OTHER, "b1")
    one = probe.stats()["prefix_cache"]["host_bytes"]  # A's state in host memory
    eng, plain = engine(ftw, 4, prefix_cache_host_memory=str(one + one // 2), **BUDGET), engine(ftw, 0, **BUDGET)
    first_a, _ = turn(eng, FIRST, "a1")
    first_b, _ = turn(eng, OTHER, "b1")
    turn(eng, [3] * 40, "c1")  # pushes B out: A leaves the tier to make room
    assert eng.stats()["prefix_cache"]["evicted"] == 1
    got, hit = turn(eng, OTHER + first_b + [17], "b2")
    assert hit >= len(OTHER) and got == turn(plain, OTHER + first_b + [17], "b2")[0]
    got, hit = turn(eng, FIRST + first_a + [17], "a2")
    assert hit == 0 and got == turn(plain, FIRST + first_a + [17], "a2")[0]
    assert eng.stats()["prefix_cache"]["host_bytes"] <= one + one // 2


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_states_in_host_memory_are_written_to_the_prefix_cache_dir(ftw_for, arch, tmp_path):
    ftw = ftw_for(arch, "none")
    eng = engine(ftw, 4, prefix_cache_host_memory="64MiB", prefix_cache_dir=str(tmp_path), **BUDGET)
    first, _ = turn(eng, FIRST, "a1")
    turn(eng, OTHER, "b1")
    assert eng.stats()["prefix_cache"]["host_entries"] == 1
    eng.close()
    assert len(list(tmp_path.glob("prefix-*.safetensors"))) == 2
    later, plain = engine(ftw, 4, prefix_cache_dir=str(tmp_path), **BUDGET), engine(ftw, 0, **BUDGET)
    second = FIRST + first + [17, 23, 29, 31]
    got, hit = turn(later, second, "a2")
    assert hit >= len(FIRST) + len(first) - 1 and got == turn(plain, second, "a2")[0] and same(later, plain)


def test_the_host_tier_size_is_checked_with_the_other_settings():
    from ft.runtime.engine import EngineSettings

    assert EngineSettings(prefix_cache_host_memory="2GiB").prefix_cache_host_memory == 2 << 30
    with pytest.raises(ValueError, match="--prefix-cache-host-memory"):
        EngineSettings(prefix_cache_host_memory="lots")
