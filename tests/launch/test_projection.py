"""The rollout modes' discrete-event model against hand-worked timelines, and its invariants."""

from __future__ import annotations

import pytest

from agent_r1.launch.projection import Episode, compare, long_tail_workload, simulate

# two iterations of two one-step episodes (4 s and 1 s), two slots, an update of 2 s
WORK = [[Episode(1, 4.0), Episode(1, 1.0)], [Episode(1, 4.0), Episode(1, 1.0)]]


def test_sync_waits_for_the_longest_episode_then_the_update():
    # gen 0-4, update 4-6, gen 6-10, update 10-12
    o = simulate("sync", WORK, slots=2, update_s=2.0)
    assert o.seconds == 12.0 and o.steps_per_s == pytest.approx(4 / 12)
    assert o.learner_idle == pytest.approx(8 / 12)  # it trains 4 of 12 s
    assert o.rollout_idle == pytest.approx(1 - 10 / 24)  # 10 slot-seconds of 24


def test_one_step_off_starts_the_next_batch_when_the_last_ends():
    # gen 0 ends at 4; gen 1 starts at 4 (4-8 and 4-5) beside update 0 (4-6); update 1 8-10
    o = simulate("one_step_off", WORK, slots=2, update_s=2.0)
    assert o.seconds == 10.0


def test_stream_runs_the_next_batch_beside_the_long_tail():
    # eta 1: both batches start at 0; gen 1's 4 s episode takes the slot freed at 1 (1-5), its 1 s
    # one the slot freed at 4 (4-5); update 0 4-6, update 1 6-8
    o = simulate("stream", WORK, slots=2, update_s=2.0, eta=1)
    assert o.seconds == 8.0 and o.mode == "stream_eta1"
    # eta 0 is the synchronous schedule
    assert simulate("stream", WORK, slots=2, update_s=2.0, eta=0).seconds == 12.0


def test_more_staleness_never_slows_and_the_update_bounds_it():
    work = long_tail_workload(12, 64, token_s=0.002, seed=3)
    out = {o.mode: o for o in compare(work, slots=32, update_s=1.0, update_per_step_s=0.02)}
    s = [out[m].steps_per_s for m in ("sync", "stream_eta1", "stream_eta2", "stream_eta4")]
    assert s == sorted(s) and s[1] > s[0]
    assert out["one_step_off"].steps_per_s >= out["sync"].steps_per_s
    steps = sum(e.steps for b in work for e in b)
    learner_only = sum(1.0 + 0.02 * sum(e.steps for e in b) for b in work)
    assert out["stream_eta4"].steps_per_s <= steps / learner_only + 1e-9  # never faster than the learner


def test_the_workload_is_heavy_tailed_and_seeded():
    a = long_tail_workload(4, 256, token_s=0.001, seed=1, max_steps=8)
    assert a == long_tail_workload(4, 256, token_s=0.001, seed=1, max_steps=8)
    lengths = sorted(e.seconds for b in a for e in b)
    assert lengths[-1] > 10 * lengths[len(lengths) // 2]  # the tail is far from the median
    assert {e.steps for b in a for e in b} <= set(range(2, 9))


def test_a_bad_mode_is_named():
    with pytest.raises(ValueError, match="sync, one_step_off or stream"):
        simulate("fast", WORK, 1, 1.0)
