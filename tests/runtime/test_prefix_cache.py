"""The engine's prefix cache (`ft.runtime.prefix_cache`): a later prompt that starts with a finished request's tokens
prefills only the rest, and greedy output is the same as without the cache; attention-only, hybrid (Gated DeltaNet)
and compressed-attention (deepseek_v4) families; kept states give way to running requests."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.engine import Engine, EngineSettings
from ft.runtime.model import Segment
from prefix_lib import ARCHS, FIRST, GREEDY, SNAPSHOTTED, engine as _engine, same as _same, turn as _turn

@pytest.mark.parametrize("arch", ARCHS)
def test_the_next_turn_reuses_the_whole_conversation_and_decodes_the_same(ftw_for, arch):
    ftw = ftw_for(arch, "none")
    cached_eng, plain = _engine(ftw, 4), _engine(ftw, 0)
    first, hit = _turn(cached_eng, FIRST, "t1")
    assert hit == 0 and first == _turn(plain, FIRST, "t1")[0]
    second = FIRST + first + [17, 23, 29, 31]  # the conversation so far + the next user message
    got, hit = _turn(cached_eng, second, "t2")
    assert got == _turn(plain, second, "t2")[0] and _same(cached_eng, plain)
    # the state consumed the prompt and every output token but maybe the last (it ended the request)
    assert len(FIRST) + len(first) - 1 <= hit <= len(FIRST) + len(first)
    stats = cached_eng.stats()["prefix_cache"]
    assert stats["hits"] == 1 and stats["hit_tokens"] == hit and stats["entries"] == 1  # t2's state is kept now


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rerendered_reply_reuses_the_prompt(ftw_for, arch):
    """The client sends the previous reply back in another form (e.g. without its thinking): the prompt before it
    still matches. Attention reuses the longest common prefix; the hybrid and compressed models resume from the state
    they snapshotted at the end of the first prompt."""
    ftw = ftw_for(arch, "none")
    cached_eng, plain = _engine(ftw, 4), _engine(ftw, 0)
    first, _ = _turn(cached_eng, FIRST, "t1")
    second = FIRST + [(t + 1) % 150 + 20 for t in first] + [17, 23]
    got, hit = _turn(cached_eng, second, "t2")
    assert got == _turn(plain, second, "t2")[0] and _same(cached_eng, plain)
    common = next(i for i, (a, b) in enumerate(zip(FIRST + first, second)) if a != b)
    assert hit == (common if arch == "qwen3_moe" else len(FIRST))


@pytest.mark.parametrize("arch,expect", [("qwen3_moe", 20), ("qwen3_5_moe", 16), ("deepseek_v4", 16)])
def test_a_shorter_common_prefix_is_reused_up_to_an_exact_state(ftw_for, arch, expect):
    """A prompt sharing 20 tokens: attention reuses all 20; the hybrid and compressed models the last point where
    their state was snapshotted, the end of the first 16-token prefill chunk."""
    ftw = ftw_for(arch, "none")
    eng, plain = _engine(ftw, 4), _engine(ftw, 0)
    _turn(eng, FIRST, "t1")
    got, hit = _turn(eng, FIRST[:20] + [1, 2, 3], "t2")
    assert hit == expect and got == _turn(plain, FIRST[:20] + [1, 2, 3], "t2")[0] and _same(eng, plain)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_snapshot_where_the_server_expects_the_next_prompt_to_diverge(ftw_for, arch):
    """The server names the start of the assistant header (`snapshot_at`): the hybrid and compressed models end a
    prefill chunk there and keep their state, so a next prompt that re-renders everything after it resumes there, not
    at the chunk end before it; attention-only models need no extra chunk end."""
    ftw = ftw_for(arch, "none")
    eng, plain = _engine(ftw, 4), _engine(ftw, 0)
    _turn(eng, FIRST, "t1", snapshot_at=21)
    kept = set(eng.prefix.entries[0].snapshots)
    assert kept == ({16, 21, 30} if arch in SNAPSHOTTED else set())  # chunks of 16 + 5 + 9 tokens; none needed
    third = FIRST[:21] + [4, 5, 6]
    got, hit = _turn(eng, third, "t3")
    assert hit == 21 and got == _turn(plain, third, "t3")[0] and _same(eng, plain)


def test_kept_states_give_way_to_running_requests(ftw_for):
    ftw = ftw_for("qwen3_moe", "none")
    eng = _engine(ftw, 4, kv_reserve_tokens=64)  # room for one conversation at a time
    _turn(eng, FIRST, "t1")
    assert eng.stats()["kv_tokens_cached"] > 0
    other = [(5 * i + 1) % 170 + 9 for i in range(40)]  # needs the whole budget, shares nothing
    out, hit = _turn(eng, other, "t2")
    assert hit == 0 and len(out) == GREEDY.max_tokens
    stats = eng.stats()
    assert stats["prefix_cache"]["evicted"] >= 1 and stats["preemptions"] == 0
    assert stats["kv_tokens_used"] == 0 and eng.kv.used == stats["kv_tokens_cached"] <= eng.kv.total


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_running_together_share_a_kept_prefix(ftw_for, arch):
    """An agent's parallel calls (or a forked conversation) start with the same kept conversation: every one of them
    reuses it, each decodes as without the cache, and only the states they leave behind stay (the one they forked
    from is superseded)."""
    ftw = ftw_for(arch, "none")
    eng, plain = _engine(ftw, 4), _engine(ftw, 0)
    first, _ = _turn(eng, FIRST, "t1")
    forks = {f"f{i}": FIRST + first + tail for i, tail in enumerate(([17, 23, 29], [40, 41], [7, 7, 7, 7]))}
    for rid, prompt in forks.items():
        eng.add_request(rid, prompt, GREEDY)
    outs, cached = {rid: [] for rid in forks}, {}
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.token_id is not None:
                outs[ev.request_id].append(ev.token_id)
            cached[ev.request_id] = ev.num_cached_tokens
    for rid, prompt in forks.items():
        assert len(FIRST) + len(first) - 1 <= cached[rid] <= len(FIRST) + len(first)
        assert outs[rid] == _turn(plain, prompt, rid)[0]
    stats = eng.stats()["prefix_cache"]
    assert stats["hits"] == stats["shared"] == 3 and stats["superseded"] >= 1 and stats["entries"] == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_with_no_room_for_a_copy_the_kept_state_itself_is_taken(ftw_for, arch):
    """A budget that cannot hold the request beside the kept state: the request takes the state itself (no copy is
    allocated beyond the budget), as when a state served one request at a time."""
    ftw = ftw_for(arch, "none")
    eng, plain = _engine(ftw, 4, kv_reserve_tokens=80), _engine(ftw, 0, kv_reserve_tokens=80)
    first, _ = _turn(eng, FIRST, "t1")
    second = FIRST + first + [17, 23, 29, 31]
    got, hit = _turn(eng, second, "t2")
    assert got == _turn(plain, second, "t2")[0] and _same(eng, plain)
    stats = eng.stats()["prefix_cache"]
    assert hit >= len(FIRST) and stats["hits"] == 1 and stats["shared"] == 0 and stats["entries"] == 1


def test_a_copied_state_is_independent_of_the_kept_one(ftw_for):
    eng = Engine(ftw_for("qwen3_5_moe", "none"), EngineSettings(prefix_cache_entries=0))
    st = eng.model.new_state(32)
    eng.model.forward(torch.tensor(FIRST[:12]), [Segment(st, 12)])
    copy = st.clone(12, capacity=20)
    assert copy.capacity == 20 and copy.length == 12
    eng.model.forward(torch.tensor(FIRST[12:16]), [Segment(copy, 4)])  # the copy goes on, the kept one stays
    assert copy.length == 16 and st.length == 12
    for i, (k, _) in st.kv.items():
        assert torch.equal(copy.kv[i][0][:12], k[:12])
    for i, r in st.recurrent.items():
        assert not torch.equal(copy.recurrent[i], r)
    with pytest.raises(ValueError, match="snapshot"):
        st.clone(8)  # a recurrent model resumes at another length only from a snapshot


@pytest.mark.parametrize("arch", SNAPSHOTTED)
def test_a_conversation_keeps_its_earlier_snapshots(ftw_for, arch):
    """The second turn takes the first turn's state; a third prompt that shares only the first 20 tokens still
    resumes at 16 (the first turn's first chunk end), which the second turn's kept state inherited."""
    ftw = ftw_for(arch, "none")
    eng, plain = _engine(ftw, 4), _engine(ftw, 0)
    first, _ = _turn(eng, FIRST, "t1")
    _, hit = _turn(eng, FIRST + first + [17, 23, 29], "t2")
    assert hit >= len(FIRST) and eng.stats()["prefix_cache"]["entries"] == 1
    third = FIRST[:20] + [4, 5, 6]
    got, hit = _turn(eng, third, "t3")
    assert hit == 16 and got == _turn(plain, third, "t3")[0] and _same(eng, plain)


@pytest.mark.parametrize("arch", ARCHS)
def test_kept_states_survive_a_restart(ftw_for, arch, tmp_path, caplog):
    """--prefix-cache-dir: the states kept at shutdown are loaded by the next engine on the same model, which then
    resumes the conversation (same logprobs as without any cache); files of another model, or damaged ones, are
    skipped with a log line."""
    ftw = ftw_for(arch, "none")
    first_run = _engine(ftw, 4, prefix_cache_dir=str(tmp_path))
    first, _ = _turn(first_run, FIRST, "t1")
    first_run.close()
    saved = list(tmp_path.glob("prefix-*.safetensors"))
    assert len(saved) == 1
    (tmp_path / "prefix-damaged.safetensors").write_bytes(b"\0" * 64)
    second_run, plain = _engine(ftw, 4, prefix_cache_dir=str(tmp_path)), _engine(ftw, 0)
    assert second_run.stats()["prefix_cache"]["entries"] == 1 and "prefix-damaged" in caplog.text
    second = FIRST + first + [17, 23, 29, 31]
    got, hit = _turn(second_run, second, "t2")
    assert hit >= len(FIRST) + len(first) - 1
    assert got == _turn(plain, second, "t2")[0] and _same(second_run, plain)
    second_run.close()
    other = ftw_for("qwen3_5_moe" if arch == "qwen3_moe" else "qwen3_moe", "none")
    third_run = _engine(other, 4, prefix_cache_dir=str(tmp_path))  # another model: nothing of it is loaded ...
    assert third_run.stats()["prefix_cache"]["entries"] == 0 and "another model" in caplog.text
    assert len(list(tmp_path.glob("prefix-*.safetensors"))) == 1  # ... and the first model's state stays
    assert not (tmp_path / "prefix-damaged.safetensors").exists()


@pytest.mark.parametrize("arch", SNAPSHOTTED)
def test_kept_states_are_written_while_serving(ftw_for, arch, tmp_path):
    """The server persists the kept states while idle: a process killed after that (no shutdown) still leaves them
    for the next one; a state taken by a request loses its file at the next call, unchanged states are not
    rewritten."""
    ftw = ftw_for(arch, "none")
    run = _engine(ftw, 4, prefix_cache_dir=str(tmp_path))
    first, _ = _turn(run, FIRST, "t1")
    assert run.persist_prefixes() == 1 and run.persist_prefixes() == 0  # nothing changed since
    (saved,) = tmp_path.glob("prefix-*.safetensors")
    second = FIRST + first + [17, 23, 29, 31]
    _turn(run, second, "t2")  # takes the kept state, keeps a longer one
    assert run.persist_prefixes() == 1
    (now,) = tmp_path.glob("prefix-*.safetensors")
    assert now != saved and not saved.exists()
    # killed here: no close(), so no shutdown save; the next process finds the state written while idle
    written = now.stat().st_mtime_ns
    later, plain = _engine(ftw, 4, prefix_cache_dir=str(tmp_path)), _engine(ftw, 0)
    assert later.persist_prefixes() == 0 and now.stat().st_mtime_ns == written  # loaded, its file kept as it is
    third = second + [5, 7, 9]
    got, hit = _turn(later, third, "t3")
    assert hit >= len(second) and got == _turn(plain, third, "t3")[0]
