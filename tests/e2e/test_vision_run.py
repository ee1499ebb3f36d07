"""A vision-language agent trained end to end: the visual_arithmetic preset cut to 2 iterations on
a tiny Qwen2-VL the launcher builds. Images go from the rows through the rollout server (SGLang's
``image_data``) into the shards and the learner's vision tower; after each weight sync the learner
recomputes the sampled tokens' logprobs with the images exactly as the server sampled them."""

from __future__ import annotations

from train_checks import check_events, check_finished, read_records, reduced, train

from agent_r1.records.schema import table_images


def test_visual_arithmetic_two_iterations(tmp_path):
    model, run = tmp_path / "tiny-qwen2vl", tmp_path / "va"
    r = train(reduced(model, run, preset="visual_arithmetic_grpo", build=True))
    check_finished(r, run, 2)
    scalars = check_events(run, 2)
    assert max(v for _, v in scalars["mismatch/abs_logprob_diff_rollout_learner"]) < 1e-3
    t = read_records(run, 1)
    refs = t.column("images").to_pylist()
    assert all(len(x) == 1 for x in refs)  # every observation shows its row's picture
    stored = table_images(t)  # checked against their hashes
    assert {h for (_, h) in stored} == {x[0] for x in refs}
    assert len(stored) == len(set(t.column("trajectory_id").to_pylist()))  # once per trajectory
    versions = {int(v) for v in t.column("policy_version").to_pylist()}
    assert versions == {2}
