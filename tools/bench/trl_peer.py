#!/usr/bin/env python
"""End to end against TRL: the same GRPO job run by ``agent-r1 train`` and by TRL's own
``GRPOTrainer``, then every checkpoint of both evaluated by the same evaluator on the same held-out
rows. Prints, per task, the wall time each system needed to reach the same held-out accuracy (the
midpoint between the start and the lower of the two final values) and the final accuracies:

    BENCH e2e_smollm2_<task> time_to_accuracy_s=<ours> baseline=trl_grpo ratio=<trl / ours>

    python tools/bench/trl_peer.py [--experiment smollm2_arithmetic_grpo] [--budget-s 3000]
        [--save-every-s 300] [--out DIR] [-- overrides for both]

The job is the preset's: its model, train rows, reward (the recipe's reward function, called by
TRL as its ``reward_funcs``), group size, prompts per step, optimizer steps per generation
(``algorithm.mini_batches`` -> ``steps_per_generation``), learning rate (constant), clip
(0.2 / 0.28: GRPO's clip-higher, ``epsilon`` / ``epsilon_high``), token-mean loss (TRL's ``dapo``),
no KL (``beta=0``), temperature and max tokens; both in float32 on the CPU (``use_cpu=True``), each
under the same wall budget. TRL generates with transformers' ``generate`` (``use_vllm=False``: no
vLLM on a CPU here); its fastest CPU settings: no gradient checkpointing (memory is no constraint at
135M), ``torch_compile`` off (its recompiles per shape cost more than they save at these lengths).

TRL is not a dependency of the project: it is installed once into ``.cache/trl-peer`` (``make
bench-e2e`` does: ``pip install --no-deps --target .cache/trl-peer trl==1.16.0 datasets==5.2.0
dill==0.4.1 multiprocess==0.70.19``; everything else it needs is already in the project's venv).

Our side's in-run evaluations (at its start and end) count against its budget; TRL evaluates
nothing in-run. A checkpoint's time is the seconds since its process started.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRL_SITE = ROOT / ".cache" / "trl-peer"
PINNED = "trl==1.16.0"


def load_cfg(experiment: str, overrides: list[str]):
    from agent_r1.train.config import load_config

    return load_config([f"+experiment={experiment}", *overrides])


# ---- TRL's side (run in its own process: ``--trl-child``) ------------------------------------------
def trl_child(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(TRL_SITE))
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent_r1.rewards import compute_reward
    from agent_r1.train.splits import split_rows
    from recipes import load_all

    t0 = time.time()
    if f"trl=={trl.__version__}" != PINNED:
        raise SystemExit(f"TRL {trl.__version__} found; this peer is checked against {PINNED}")
    load_all()
    cfg = load_cfg(a.experiment, a.overrides)
    rows = split_rows(cfg, "train")
    data = Dataset.from_list([{"prompt": r.prompt, "reward_model": json.dumps(r.reward_model)} for r in rows])

    def reward(completions, reward_model, **_):
        return [
            compute_reward(json.loads(rm), c[0]["content"]).score
            for c, rm in zip(completions, reward_model, strict=True)
        ]

    ro, ep, opt = cfg.rollout, cfg.episode, cfg.optim
    pol = cfg.algorithm.policy
    out = Path(a.out) / "trl"
    saves: list[dict] = []

    class Budget(TrainerCallback):
        """Stop when the wall budget is spent; save (and time) every ``save_every_s``."""

        last = t0

        def on_step_end(self, args, state, control, **kw):
            now = time.time()
            if now - self.last >= a.save_every_s:
                control.should_save, self.last = True, now
            if now - t0 >= a.budget_s:
                control.should_save = control.should_training_stop = True

        def on_save(self, args, state, control, **kw):
            saves.append({"step": state.global_step, "seconds": time.time() - t0})
            (out / "saves.json").write_text(json.dumps(saves))

    per_step = ro.prompts_per_iteration * ro.group_size // cfg.algorithm.mini_batches
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=cfg.model.dtype == "bfloat16",
        gradient_checkpointing=False,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=cfg.algorithm.mini_batches,
        num_generations=ro.group_size,
        max_completion_length=ep.max_action_tokens,
        temperature=ep.temperature,
        learning_rate=opt.lr,
        lr_scheduler_type="constant",
        max_grad_norm=opt.clip_grad,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        weight_decay=opt.weight_decay,
        beta=pol.kl_coef,
        epsilon=pol.clip_low,
        epsilon_high=pol.clip_high,
        loss_type="dapo",
        max_steps=10**6,  # the budget stops it
        save_strategy="no",  # the callback saves
        save_only_model=True,
        logging_steps=1,
        report_to=[],
        seed=cfg.trainer.seed,
    )
    trainer = GRPOTrainer(
        model=cfg.model.path, reward_funcs=reward, args=args, train_dataset=data, callbacks=[Budget()]
    )
    trainer.train()


# ---- the driver --------------------------------------------------------------------------------------
def run_ours(a: argparse.Namespace, out: Path) -> list[dict]:
    run = out / "ours"
    every = max(1, round(a.save_every_s / a.iteration_s_guess))
    cmd = [sys.executable, "-m", "agent_r1.cli", "train", f"+experiment={a.experiment}", *a.overrides,
           f"trainer.run_dir={run}", f"trainer.max_wall_s={a.budget_s}", f"trainer.checkpoint_every={every}",
           "trainer.keep_checkpoints=1000", "trainer.eval_every=0", "trainer.progress=false"]  # fmt: skip
    subprocess.run(cmd, check=True)
    saves = []
    for state in sorted((run / "checkpoints").glob("iter_*/agent_r1_state.json")):
        s = json.loads(state.read_text())["trainer"]
        saves.append({"iteration": s["iteration"], "seconds": s["wall_seconds"], "path": str(run)})
    return saves


def run_trl(a: argparse.Namespace, out: Path) -> list[dict]:
    cmd = [sys.executable, __file__, "--trl-child", "--experiment", a.experiment, "--out", str(out),
           "--budget-s", str(a.budget_s), "--save-every-s", str(a.save_every_s), "--", *a.overrides]  # fmt: skip
    subprocess.run(cmd, check=True)
    saves = json.loads((out / "trl" / "saves.json").read_text())
    return [dict(s, path=str(out / "trl" / f"checkpoint-{s['step']}")) for s in saves]


def evaluate(source: list[str], data: Path, out: Path, episode_flags: list[str]) -> float:
    if not (out / "metrics.json").exists():
        cmd = [sys.executable, "-m", "agent_r1.cli", "eval", *source, "--data", str(data), "--out", str(out),
               "--no-progress", *episode_flags]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
    return json.loads((out / "metrics.json").read_text())["success"]


def time_to(target: float, curve: list[tuple[float, float]]) -> float | None:
    """The first checkpoint time whose held-out success reaches ``target`` (None: never)."""
    return next((t for t, acc in curve if acc >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="smollm2_arithmetic_grpo")
    ap.add_argument("--budget-s", type=float, default=3000.0)
    ap.add_argument("--save-every-s", type=float, default=300.0)
    ap.add_argument("--iteration-s-guess", type=float, default=170.0, help="ours: seconds per iteration")
    ap.add_argument("--out", default="runs/bench_e2e")
    ap.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.trl_child:
        return trl_child(a)
    if not (TRL_SITE / "trl").is_dir():
        raise SystemExit(f"TRL is not installed in {TRL_SITE}: run `make bench-e2e` (it installs {PINNED})")
    from agent_r1.data.rows import write_rows
    from agent_r1.train.splits import split_rows

    cfg = load_cfg(a.experiment, a.overrides)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = write_rows(split_rows(cfg, "test"), out / "test.parquet")
    ep = cfg.episode
    flags = ["--max-steps", str(ep.max_steps), "--max-obs-tokens", str(ep.max_obs_tokens),
             "--max-action-tokens", str(ep.max_action_tokens), "--dtype", cfg.model.dtype]  # fmt: skip
    start = evaluate(["--model", cfg.model.path], data, out / "evals" / "start", flags)
    print(f"held-out success at the start: {start:.3f} ({data})", flush=True)
    curves = {}
    for name, runner in (("ours", run_ours), ("trl", run_trl)):
        curve = [(0.0, start)]
        for s in runner(a, out):
            tag = f"{name}-{s.get('iteration', s.get('step'))}"
            src = (
                ["--run", s["path"], "--iteration", str(s["iteration"])]
                if name == "ours"
                else ["--model", s["path"]]
            )
            curve.append((s["seconds"], evaluate(src, data, out / "evals" / tag, flags)))
            print(f"{name} {tag}: {s['seconds']:.0f} s held-out success {curve[-1][1]:.3f}", flush=True)
        curves[name] = curve
    final = {k: v[-1][1] for k, v in curves.items()}
    target = start + (min(final.values()) - start) / 2
    t = {k: time_to(target, v) for k, v in curves.items()}
    (out / "result.json").write_text(json.dumps({"start": start, "target": target, "curves": curves, "final": final,
                                                 "time_to_target_s": t}, indent=1))  # fmt: skip
    task = cfg.recipe.options.get("task", cfg.recipe.name)
    print(
        f"held-out start {start:.3f}, final ours {final['ours']:.3f} / TRL {final['trl']:.3f}, target {target:.3f}"
    )
    if t["ours"] and t["trl"]:
        print(
            f"BENCH e2e_smollm2_{task} time_to_accuracy_s={t['ours']:.0f} baseline=trl_grpo ratio={t['trl'] / t['ours']:.2f}"
        )
    else:
        print(
            f"BENCH e2e_smollm2_{task} time_to_accuracy_s={t['ours']} baseline=trl_grpo ratio=nan (a system never reached {target:.3f})"
        )


if __name__ == "__main__":
    main()
