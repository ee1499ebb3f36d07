"""Where the policy of ``rollout``, ``eval``, ``infer`` and ``chat`` comes from: an HF folder, a
run's checkpoint (exported to an HF folder) or a running server. ``resolve_policy`` gives its
codec, episode settings (the run's, each overridden by the command line where given) and services;
``serving`` starts embedded servers for it where no URL was given."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent_r1.agent.episode import GREEDY, EpisodeSettings
from agent_r1.errors import AgentR1Error, UsageError

log = logging.getLogger("agent_r1.policy")
ROOT = Path(__file__).resolve().parents[2]


def newest_checkpoint(run: Path, iteration: int | None, strict: bool = False) -> Path:
    """The checkpoint of ``iteration``, else the newest one that passes its checksums: a damaged
    newer one is skipped with a warning naming its file (``strict``: an error)."""
    from agent_r1.learner.checkpoint_files import CheckpointError, verify_checksums
    from agent_r1.records.shard import iteration_dirs

    done = {
        i: p for i, p in iteration_dirs(run / "checkpoints").items() if (p / "agent_r1_state.json").exists()
    }
    if not done:
        raise AgentR1Error(f"{run} has no complete checkpoint under {run / 'checkpoints'}")
    if iteration is not None:
        if iteration not in done:
            raise UsageError(f"--iteration {iteration}: {run} has no checkpoint of it (have {sorted(done)})")
        verify_checksums(done[iteration])
        return done[iteration]
    damaged = []
    for i in sorted(done, reverse=True):
        try:
            verify_checksums(done[i])
        except CheckpointError as e:
            if strict:
                raise
            log.warning("skipping damaged checkpoint: %s", e)
            damaged.append(done[i].name)
            continue
        if damaged:
            log.warning("using %s, the newest intact checkpoint (damaged: %s)", done[i], ", ".join(damaged))
        return done[i]
    raise AgentR1Error(f"{run}: every checkpoint is damaged ({', '.join(damaged)}); see the warnings above")


def export_checkpoint(ckpt: Path, hf_like: Path, out: Path, dtype: str | None = None) -> Path:
    """A Megatron checkpoint of any TP/PP layout -> an HF folder with the tokenizer and chat template
    of ``hf_like`` (``tools/convert_checkpoint.py`` in its own process), optionally cast to ``dtype``."""
    if (out / "model.safetensors").exists():
        return out
    cmd = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "megatron-to-hf",
           "--ckpt", str(ckpt), "--hf", str(hf_like), "--out", str(out)]  # fmt: skip
    r = subprocess.run([*cmd, *(["--dtype", dtype] if dtype else [])], capture_output=True, text=True)
    if r.returncode != 0:
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        raise AgentR1Error(f"exporting {ckpt} failed: {lines[-1] if lines else f'exit {r.returncode}'}")
    return out


def resolve_model(a: Any, export_dir: Path) -> tuple[Any, str | None, str]:
    """(the run's config or None, an HF folder or None for ``--url``, what is evaluated) of
    ``--model`` / ``--run [--iteration]`` / ``--url``; a run's checkpoint is exported under
    ``export_dir``. Errors say what is wrong with which path."""
    if sum(bool(x) for x in (a.model, a.run, a.url)) != 1:
        raise UsageError("give one of --model DIR, --run RUN_DIR or --url URL")
    if getattr(a, "base", False) and not a.run:
        raise UsageError("--base needs --run (the run whose starting model and settings to use)")
    if a.model and not (Path(a.model) / "config.json").exists():
        raise UsageError(f"--model {a.model}: not an HF model folder (no config.json)")
    if not a.run:
        return None, a.model, a.model or a.url
    from agent_r1.train.config import from_yaml

    run = Path(a.run)
    if not (run / "config.yaml").exists():
        raise UsageError(f"--run {run}: not a run directory (no config.yaml)")
    cfg = from_yaml(run / "config.yaml")
    if getattr(a, "base", False):  # the model the run started from, with the run's settings
        if a.iteration is not None:
            raise UsageError("--base and --iteration: choose one (--base is the model before any training)")
        return cfg, cfg.model.path, cfg.model.path
    ckpt = newest_checkpoint(run, a.iteration, getattr(a, "strict", False))
    log.info("exporting %s to an HF folder", ckpt)
    return cfg, str(export_checkpoint(ckpt, Path(cfg.model.path), export_dir / f"hf_{ckpt.name}")), str(ckpt)


def start_server(
    model: str, max_len: int, dtype: str, threads: int | None, workdir: Path
) -> tuple[subprocess.Popen, str]:
    """``agent-r1 serve`` on a free loopback port, as its own process (as the trainer's servers);
    its ready file and log in ``workdir``."""
    from agent_r1.process import die_with_parent

    workdir.mkdir(parents=True, exist_ok=True)
    ready, log_path = workdir / "server.json", workdir / "server.log"
    cmd = [sys.executable, "-m", "agent_r1.cli", "serve", "--model", model, "--port", "0",
           "--max-len", str(max_len), "--dtype", dtype, "--ready-file", str(ready), "--strict"]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    # its own session: a Ctrl-C at the terminal (a chat's) reaches this process, not the server
    # its log goes to a file (a pipe nobody drains would stop the server once it filled)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            preexec_fn=die_with_parent(),
            start_new_session=True,
        )
    deadline = time.time() + 300
    while not ready.exists():
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise AgentR1Error(f"the embedded server failed to start: {tail}")
        if time.time() > deadline:
            proc.kill()
            raise AgentR1Error("the embedded server did not start within 300 s")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


def episode_settings(a: argparse.Namespace, cfg: Any) -> EpisodeSettings:
    """The run's episode settings as its evaluation uses them (``cfg``: the run's config), else the
    defaults, greedy; each overridden by its flag where given."""
    if cfg is not None:
        base = replace(cfg.episode, temperature=cfg.trainer.eval_temperature, top_p=1.0)
    else:
        base = EpisodeSettings(temperature=GREEDY)
    return base.with_values({k: getattr(a, k, None) for k in base.to_dict()})


@dataclass
class Policy:
    """A resolved policy: what it is, its codec, the servers answering for it, and the settings."""

    source: str  # what is evaluated: the folder, the checkpoint or the URL
    model: str | None  # the HF folder (None with --url)
    cfg: Any  # the run's config with --run, else None
    codec: Any
    episode: EpisodeSettings
    seed: int
    urls: list[str] = field(default_factory=list)
    api_key: str | None = None
    services: Any = None  # what its episodes use besides it: the search tools' index (--index, the run's)

    def run_episodes(self, rows: list[Any], n: int, wait_s: float = 0.0, **kw: Any) -> list[Any]:
        """``n`` episodes of each row against this policy's servers, under its episode settings
        (``kw``: ``run_episodes``'s options); ``wait_s``: wait that long for the servers first."""
        import asyncio

        from agent_r1.agent.run_episodes import run_episodes

        async def go() -> list[Any]:
            client = self.client()
            try:
                if wait_s:
                    await client.wait_ready(wait_s)
                flow = self.episode.flow(self.seed)
                return await run_episodes(rows, client, self.codec, flow, n, services=self.services, **kw)
            finally:
                await client.close()

        return asyncio.run(go())

    def client(self) -> Any:
        from agent_r1.rollout.client import RolloutClient

        routers = [u.split("=", 1)[1] for u in self.urls if u.startswith("router=")]
        if routers:
            return RolloutClient(router=routers[0], api_key=self.api_key)
        return RolloutClient(servers=self.urls, api_key=self.api_key)


def resolve_policy(a: argparse.Namespace, export_dir: Path) -> Policy:
    """The policy of ``--model`` / ``--run`` / ``--url``: its codec, episode settings and services
    (a run's checkpoint exported under ``export_dir``); nothing is started."""
    from agent_r1.agent.chat import ChatCodec
    from agent_r1.train.run_services import local_services

    cfg, model, source = resolve_model(a, export_dir)
    tokenizer = a.tokenizer or model or (cfg.model.path if cfg is not None else None)
    if tokenizer is None:
        raise UsageError("--url needs --tokenizer (an HF folder with the model's tokenizer)")
    episode = episode_settings(a, cfg)
    seed = a.seed if a.seed is not None else (cfg.trainer.seed if cfg is not None else 0)
    urls = [u for x in ([a.url] if isinstance(a.url, str) else a.url or []) for u in x.split(",")]
    services = local_services(getattr(a, "index", None), cfg)
    return Policy(source, model, cfg, ChatCodec.load(tokenizer), episode, seed, urls, a.api_key, services)


@contextmanager
def serving(
    policy: Policy, a: argparse.Namespace, servers: int = 1, announce: bool = False
) -> Iterator[Policy]:
    """``policy`` answered by ``servers`` embedded servers (``--max-len``, ``--dtype``) until the
    block ends; with ``--url`` by the servers given."""
    import tempfile

    cfg, episode = policy.cfg, policy.episode
    procs: list[subprocess.Popen] = []
    work = tempfile.TemporaryDirectory(prefix="agent_r1_serve_")  # ready files and logs, removed after
    try:
        if not policy.urls:
            max_len = a.max_len or (cfg.model.max_len if cfg is not None else episode.context_len)
            if episode.context_len > max_len:
                raise UsageError(
                    f"--max-obs-tokens {episode.max_obs_tokens} + --max-action-tokens {episode.max_action_tokens}"
                    f" do not fit --max-len {max_len} (the server's context)"
                )
            dtype = a.dtype or (cfg.model.dtype if cfg is not None else "float32")
            threads = cfg.rollout.server_cpus if cfg is not None else None
            if announce:
                print(f"starting the embedded engine for {policy.model} ...", flush=True)
            for i in range(servers):
                proc, url = start_server(
                    policy.model, max_len, dtype, threads, Path(work.name) / f"server_{i}"
                )
                procs.append(proc)
                policy.urls.append(url)
        yield policy
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        work.cleanup()
