"""`agent-r1 train` end to end: real processes (learner over gloo, `agent-r1 serve` rollout servers,
rollout workers), real shards, real TensorBoard event files. Reduced quickstart runs of 2 iterations
in each algorithm family; kill -9 of the whole run then `resume=auto`; Ctrl-C. (Servers killed
mid-rollout: test_faults.py; PSPO on two data-parallel ranks: test_slurm.py's two-node run.)"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

import pytest
from train_checks import (
    check_eval_reproduces,
    check_events,
    check_finished,
    ledger,
    manifest,
    read_records,
    read_scalars,
    reduced,
    run_until,
    start_train,
    train,
    wait_for,
)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_dir):
    """A second tiny model with the same tokenizer (same text, same vocab) and other weights."""
    from agent_r1.agent_tools import TOOLS
    from agent_r1.models.tiny import build_tiny_model
    from recipes import load_recipe

    out = tmp_path_factory.mktemp("teacher") / "qwen3"
    texts = load_recipe("arithmetic_tool").corpus(num=300) + load_recipe("gsm8k").corpus()
    build_tiny_model(out, texts, [TOOLS.get("calculator")().schema], arch="qwen3", vocab_size=800, seed=7)
    assert (out / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    return out


def test_grpo_two_iterations(tiny_model_dir, tmp_path):
    run = tmp_path / "grpo"
    r = train(reduced(tiny_model_dir, run, "algorithm=grpo", "episode.temperature=0.7"))
    s = check_finished(r, run, 2)
    assert s["algorithm"] == "grpo"
    scalars = check_events(run, 2)
    # sync mode: the learner recomputes exactly what the server sampled with (weights synced), at
    # the sampling temperature: SGLang's logprobs are under softmax(logits / T), and so are the
    # learner's (untempered, the mean difference here is 0.06)
    assert max(v for _, v in scalars["mismatch/abs_logprob_diff_rollout_learner"]) < 1e-3
    assert all(v == 0 for _, v in scalars["staleness/max"])
    # SFT bumped the version to 1; each update bumps it again; records carry the sampling version
    versions = [int(v) for v in read_records(run, 1).column("policy_version").to_pylist()]
    assert set(versions) == {2}
    assert (run / "curve.png").stat().st_size > 1000
    assert "held-out success" in r.stdout
    texts = list((run / "logs").glob("*.log"))
    assert {p.stem for p in texts} >= {"learner_0", "server_0", "worker_0"}
    # the run's servers are strict (only upstream SGLang's endpoints): nothing asked for another
    server_log = (run / "logs" / "server_0.log").read_text()
    assert "strict: 404" not in server_log, server_log[-2000:]


def test_an_agent_program_trains_through_the_gateway(tiny_model_dir, tmp_path):
    """The openai_agent recipe: the official-SDK program, forked per episode, through the worker's
    gateway (the run's API key): its calls are the shards' steps, token in / token out."""
    run = tmp_path / "gateway"
    s = check_finished(train(reduced(tiny_model_dir, run, preset="openai_agent")), run, 2)
    assert s["algorithm"] == "grpo"
    check_events(run, 2)
    table = read_records(run, 1)
    infos = [json.loads(i) for i in table.column("info").to_pylist()]
    assert infos and all(i["rewrite"] is False for i in infos)  # an SDK's history always extends
    steps = table.column("step_index").to_pylist()
    prefix = table.column("prefix_len").to_pylist()
    assert all(p > 0 for k, p in zip(steps, prefix, strict=True) if k > 0)  # later steps merged
    assert "env_error" not in (run / "logs" / "worker_0.log").read_text()


def test_steppo_async_two_iterations(tiny_model_dir, tmp_path):
    run = tmp_path / "steppo"
    r = train(
        reduced(
            tiny_model_dir,
            run,
            "algorithm=steppo",
            "rollout.mode=async",
            "rollout.max_staleness=1",
            "algorithm.policy.tis_cap=2.0",
        )
    )
    check_finished(r, run, 2)
    scalars = check_events(run, 2)
    assert all(0 < v <= 2.0 for _, v in scalars["tis/weight_mean"])  # importance weights, capped
    # iteration 1 was generated while iteration 0 trained: one version behind the learner
    assert dict(scalars["staleness/max"])[2] == 1.0


def test_opd_with_teacher_server(tiny_model_dir, teacher_dir, tmp_path):
    run = tmp_path / "opd"
    r = train(reduced(tiny_model_dir, run, "algorithm=opd", f"algorithm.teacher={teacher_dir}"))
    check_finished(r, run, 2)
    check_events(run, 2)
    t = read_records(run, 0)
    teacher = [x for row in t.column("teacher_logprobs").to_pylist() for x in row]
    student = [x for row in t.column("action_logprobs").to_pylist() for x in row]
    assert len(teacher) == len(student) > 0 and all(math.isfinite(x) and x <= 0 for x in teacher)
    assert max(abs(a - b) for a, b in zip(teacher, student, strict=True)) > 1e-2  # another model
    assert (run / "logs" / "teacher_0.log").exists()


def test_kill_whole_run_then_resume(tiny_model_dir, tmp_path):
    run = tmp_path / "resume"
    args = reduced(tiny_model_dir, run, "trainer.iterations=4", "trainer.eval_every=2")
    p = start_train(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # kill -9 everything once iteration 2's records are committed but before it is trained
        wait_for(lambda: (run / "records" / "iter_000002" / "manifest.json").exists(), 300, "iteration 2")
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.wait(30)
    before = ledger(run)
    assert [e["iteration"] for e in before] in ([0, 1], [0, 1, 2])
    committed = manifest(run, 2)
    r = train(args)
    check_finished(r, run, 4)
    # iteration 2's records were committed by the dead run: reused, not generated again
    assert manifest(run, 2) == committed
    check_events(run, 4, eval_every=2)


def _ctrl_c(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGINT)  # the whole process group, as a terminal sends it


def test_ctrl_c_checkpoints_then_resume(tiny_model_dir, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it): the learners checkpoint
    what is trained and the run exits 3 with a resume hint; the same command then finishes it."""
    run = tmp_path / "ctrlc"
    args = reduced(tiny_model_dir, run, "trainer.iterations=3", "trainer.checkpoint_every=0")
    rc, out = run_until(
        args,
        run,
        lambda: run.joinpath("ledger.jsonl").exists() and ledger(run),
        "iteration 0 trained",
        _ctrl_c,
    )
    assert rc == 3, out[-4000:]
    assert "stopping: the learners checkpoint" in out and "the same command resumes" in out
    trained = [e["iteration"] for e in ledger(run)]
    assert trained in ([0], [0, 1]) and json.loads((run / "summary.json").read_text())["preempted"]
    # checkpoint_every=0: the only checkpoint is the one the stop wrote, of the last trained iteration
    assert sorted(c.name for c in (run / "checkpoints").glob("iter_*") if c.is_dir()) == [
        f"iter_{trained[-1]:06d}"
    ]
    r = train(args)
    check_finished(r, run, 3)
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2]


def test_ctrl_c_during_the_warm_start(tiny_model_dir, tmp_path):
    """A stop during a long SFT phase ends it within a few steps (nothing trained to checkpoint)."""
    run = tmp_path / "ctrlc_sft"
    sent = []

    def ctrl_c_in_sft(p: subprocess.Popen) -> None:
        time.sleep(2)  # into the SFT steps
        sent.append(time.time())
        _ctrl_c(p)

    sft_records = run / "sft_records" / "iter_000000" / "manifest.json"
    args = reduced(tiny_model_dir, run, "sft.steps=100000")
    rc, out = run_until(args, run, sft_records.exists, "the SFT phase", ctrl_c_in_sft, timeout=120)
    assert rc == 3 and time.time() - sent[0] < 60, out[-4000:]
    assert "stop requested during the warm start" in (run / "logs" / "learner_0.log").read_text()
    assert not list((run / "checkpoints").glob("iter_*"))


def test_ppo_with_critic_and_reference_kl_over_interleaved_stages_evaluated_and_resumed(tmp_path):
    """Policy, critic and reference split over two pipeline ranks of two virtual stages each (a
    4-layer model, the interleaved schedule; values, returns and the value loss live on the last
    stage only); the checkpoint, resharded on export, evaluates to the trainer's own held-out
    episodes; resumed with the critic."""
    run = tmp_path / "ppo"
    args = reduced(
        tmp_path / "m4",
        run,
        "model.build.layers=4",
        "algorithm=ppo",
        "algorithm.reference=true",
        "algorithm.policy.kl_coef=0.05",
        "algorithm.mini_batches=2",
        "parallel.learner_ranks=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "recipe.test_size=8",
        build=True,
    )
    r = train(args)
    check_finished(r, run, 2)
    scalars = check_events(run, 2)
    for tag in ("critic/value_loss", "loss/kl", "adv/mean"):
        assert tag in scalars and all(math.isfinite(v) for _, v in scalars[tag]), tag
    assert all(v == 2.0 for _, v in scalars["train/optimizer_steps"])  # two mini-batches
    # the critic is checkpointed beside the policy, both in their two chunks per rank
    for name in ("iter_000001", "iter_000001.critic"):
        meta = json.loads((run / "checkpoints" / name / "agent_r1_state.json").read_text())
        assert (meta["pp"], meta["vpp"]) == (2, 2), meta
    check_eval_reproduces(run, tmp_path / "eval", 8)
    # and resumed with it: one more iteration on top of the checkpoint, policy and critic loaded
    r = train([*args, "trainer.iterations=3"])
    check_finished(r, run, 3)
    log = (run / "logs" / "learner_0.log").read_text()
    assert "resumed from" in log and "iter_000001" in log and "critic resumed from" in log
    assert [e["iteration"] for e in ledger(run)] == [0, 1, 2]
    assert (run / "checkpoints" / "iter_000002.critic" / "agent_r1_state.json").exists()


def test_moe_with_experts_over_two_learner_ranks(tmp_path):
    """A tiny Qwen3-MoE, its 8 experts over two learner ranks (EP 2): each iteration's weights
    reach the server through the experts' gather (sync mode: the server's logprobs are the
    learner's own), and the routers' token shares are in TensorBoard."""
    run = tmp_path / "moe"
    args = reduced(
        tmp_path / "m", run, "model.build.arch=qwen3_moe", "parallel=cpu_dp2", "parallel.ep=2",
        "episode.temperature=0.7", build=True,
    )  # fmt: skip
    check_finished(train(args), run, 2)
    scalars = check_events(run, 2)
    assert max(v for _, v in scalars["mismatch/abs_logprob_diff_rollout_learner"]) < 1e-3
    shares = [k for k in scalars if k.startswith("moe/expert_share/")]
    assert len(shares) == 8
    for i in range(2):  # every iteration's shares sum to one
        assert sum(scalars[k][i][1] for k in shares) == pytest.approx(1.0, abs=1e-6)
    assert all(v >= 1.0 for _, v in scalars["moe/max_expert_load"])
    log = (run / "logs" / "learner_0.log").read_text()
    assert "mixture of experts: 8 experts, top 2" in log and "EP 2" in log


@pytest.mark.parametrize("chat_format", ["llama3", "harmony"])
def test_training_with_another_chat_format(chat_format, tmp_path):
    """The quickstart with a tiny model in the Llama 3 / Harmony format: demonstrations are
    rendered in that format's tool calls, the agents parse its calls and results, the run ends."""
    run = tmp_path / "run"
    args = reduced(
        tmp_path / "m", run, f"model.build.chat_format={chat_format}", build=True, action_tokens=None
    )
    s = check_finished(train(args), run, 2)
    sft = read_records(run, 0, "sft_records")
    calls = [c for x in sft.column("info").to_pylist() for c in json.loads(x).get("tool_calls", [])]
    assert calls and all(c["name"] == "calculator" and not c.get("error") for c in calls)
    assert s["eval_success_end"] is not None


def test_a_warm_start_alone_is_checkpointed_exported_and_shared(tiny_model_dir, tmp_path):
    """``trainer.iterations=0``: the warm start and its evaluation only, checkpointed (a resume
    starts at iteration 0); its export is the shared starting point of another run
    (``model.path``, ``sft.steps=0``), whose greedy evaluation before RL scores it the same."""
    import sys

    warm, shared = tmp_path / "warm", tmp_path / "shared"
    steppo = "algorithm=steppo"  # with a critic, whose optimizer has not stepped yet
    r = train(reduced(tiny_model_dir, warm, steppo, "trainer.iterations=0", "sft.steps=20"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    meta = json.loads((warm / "checkpoints" / "iter_000000" / "agent_r1_state.json").read_text())
    state = meta["trainer"]
    assert state["iteration"] == -1 and state["sft_done"] and len(state["eval"]) == 1 and meta["steps"] == 20
    assert not (warm / "records").exists() or not list((warm / "records").glob("iter_*"))
    out = tmp_path / "warm_hf"
    e = subprocess.run([sys.executable, "-m", "agent_r1.cli", "export", str(warm), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert e.returncode == 0, e.stderr[-3000:]
    r2 = train(reduced(out, shared, steppo, "sft.steps=0", "trainer.iterations=1"))
    s = check_finished(r2, shared, 1)
    assert s["eval_success_start"] == state["eval"][0][1]
    # resuming the warm-start run trains from iteration 0 without a second warm start, under a
    # wall budget: more iterations than fit end the run, evaluated and checkpointed, after the
    # iteration that leaves no room for another; a resume with the budget spent runs none
    before = json.loads((warm / "summary.json").read_text())["wall_seconds"]
    # (far more iterations than any machine runs in 30 s: a fast one ran 60 in 30 s)
    many = 100_000
    budget = [f"trainer.max_wall_s={before + 30:.0f}", f"trainer.iterations={many}", "trainer.eval_every=0"]
    r4 = train(reduced(tiny_model_dir, warm, steppo, "sft.steps=20", *budget))
    s4 = json.loads((warm / "summary.json").read_text())
    n = s4["iterations"]
    assert s4["budget_spent"] and 1 < n < many, s4
    check_finished(r4, warm, n)
    assert "warm start:" not in (warm / "logs" / "learner_0.log").read_text().split("resumed from")[-1]
    assert s4["eval_curve"][-1][0] == n  # the last iteration was evaluated
    scalars = read_scalars(warm / "tensorboard")
    assert [i for i, _ in scalars["eval/success"]] == [0, n]  # the warm start, this end
    longest = max(v for _, v in scalars["time/iteration"])
    assert s4["wall_seconds"] <= before + 30 + longest + 15, (s4, longest)
    r5 = train(reduced(tiny_model_dir, warm, steppo, "sft.steps=20", *budget))
    assert r5.returncode == 0 and json.loads((warm / "summary.json").read_text())["iterations"] == n
    assert "no iteration left to run" in (warm / "logs" / "learner_0.log").read_text()
