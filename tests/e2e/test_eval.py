"""`agent-r1 eval`: a run's checkpoint evaluated exactly as the trainer evaluated it, and a sampled
evaluation with pass@k (the metrics themselves: tests/commands/test_eval_metrics.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from train_checks import agent_r1_eval, check_eval_reproduces, check_finished, reduced, train

from agent_r1.records.reader import RecordStore


@pytest.mark.parametrize("layout", [[], ["parallel.tp=2", "parallel.learner_ranks=2"]], ids=["tp1pp1", "tp2"])
def test_eval_of_a_run_reproduces_the_trainers_held_out_episodes(tiny_model_dir, tmp_path, layout, request):
    """The checkpoint (TP2: two shard files, resharded on export) exported to HF and served greedily
    generates what the trainer's servers generated from the weights the learner pushed (PP2:
    test_train_run.py's PPO run over two stages)."""
    if layout:
        run = tmp_path / "run"
        check_finished(train(reduced(tiny_model_dir, run, "recipe.test_size=8", *layout)), run, 2)
    else:  # the shared run (recipe.test_size=4)
        run = request.getfixturevalue("finished_run")
    check_eval_reproduces(run, tmp_path / "eval", 8 if layout else 4)
    if not layout:  # without --out: inside the run, named by split, checkpoint and sampling
        r = agent_r1_eval("--run", str(run), "--n", "2", "--temperature", "1.0")
        inside = run / "evals" / "test-iter_000001-n2-T1"
        sampled = json.loads((inside / "metrics.json").read_text())
        assert sampled["episodes"] == 8 and f"metrics:  {inside}/metrics.json" in r.stdout
        assert (run / "evals" / "hf_iter_000001" / "model.safetensors").exists()  # one export, shared


def test_sampled_eval_reports_pass_at_k(tiny_model_dir, tmp_path):
    out = tmp_path / "sampled"
    agent_r1_eval("--model", str(tiny_model_dir), "--recipe", "arithmetic_tool", "--num", "3", "--n", "4",
          "--temperature", "1.0", "--max-steps", "2", "--max-action-tokens", "24", "--out", str(out))  # fmt: skip
    m = json.loads((out / "metrics.json").read_text())
    assert m["episodes"] == 12 and m["prompts"] == 3 and sorted(m["pass_at_k"]) == ["1", "2", "3", "4"]
    p = [m["pass_at_k"][str(k)] for k in range(1, 5)]
    assert p == sorted(p) and p[0] == pytest.approx(m["success"])  # pass@1 is the mean success
    assert 0 <= m["success_ci95"][0] <= m["success"] <= m["success_ci95"][1] <= 1
    assert RecordStore(out / "records").read(0).num_rows >= 12
    # the same rows again, compared with the first: the gain is the difference of the successes,
    # paired prompt by prompt
    again = tmp_path / "again"
    r = agent_r1_eval("--model", str(tiny_model_dir), "--recipe", "arithmetic_tool", "--num", "3", "--n", "4",
          "--temperature", "1.0", "--max-steps", "2", "--max-action-tokens", "24", "--out", str(again),
          "--seed", "1", "--baseline", str(out))  # fmt: skip
    m2 = json.loads((again / "metrics.json").read_text())
    assert m2["gain"] == pytest.approx(m2["success"] - m["success"]) and "paired bootstrap" in r.stdout
    assert m2["gain_ci95"][0] <= m2["gain"] <= m2["gain_ci95"][1]
    assert m2["baseline"]["path"] == str(out / "metrics.json") and len(m2["per_prompt_success"]) == 3


def test_export_a_run_to_bfloat16_hf(tiny_model_dir, finished_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = finished_run
    out = tmp_path / "hf_bf16"
    r = subprocess.run([sys.executable, "-m", "agent_r1.cli", "export", str(run), "--out", str(out), "--dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tok = AutoTokenizer.from_pretrained(out)  # tokenizer and chat template travel with it
    assert (
        tok.chat_template and tok.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    )
    # the bfloat16 weights are the float32 export's, rounded
    f32 = tmp_path / "hf_f32"
    subprocess.run([sys.executable, "-m", "agent_r1.cli", "export", str(run), "--out", str(f32)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    full = dict(AutoModelForCausalLM.from_pretrained(f32, dtype=torch.float32).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, full[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("case", ["not_a_model", "no_checkpoint", "bad_rows"])
def test_bad_inputs_are_one_line_errors(case, tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(
        subprocess.run(
            [sys.executable, "-m", "agent_r1.cli", "train", "+experiment=quickstart", "--print-config"],
            capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    (tmp_path / "rows.parquet").write_text("not parquet")
    args, says = {
        "not_a_model": (["--model", str(tmp_path)], "not an HF model folder (no config.json)"),
        "no_checkpoint": (["--run", str(tmp_path / "run")], "has no complete checkpoint"),
        "bad_rows": (["--model", str(tiny_model_dir), "--data", str(tmp_path / "rows.parquet")], "rows.parquet: cannot read parquet"),
    }[case]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "agent_r1.cli", "eval", *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
