#!/usr/bin/env python
"""Chaos: a training run under a seeded schedule of injected faults, then its invariant checked from
the run directory alone (``agent-r1 records audit``) and its newest checkpoint evaluated.

    python tools/chaos.py --wall 1800 --seed 0 [--mode sync|stream] [--out runs/chaos] [-- overrides]
    python tools/chaos.py --wall 900 --slurm /tmp/chaos-slurm ...   # a 2-node job on a local cluster

The run is the quickstart with an iteration count it never reaches and ``trainer.max_wall_s`` =
``--wall``: it ends when its training budget is spent, however often it was interrupted. Every
``--gap`` seconds (drawn uniformly from the range) one fault of a kind that has a target right now
is injected; a launcher that exits without finishing is started again with the same command (what
a user or Slurm's requeue does), and that restart is part of the recovery. With ``--slurm BASE`` the
run is a 2-node job (``agent-r1 launch cluster=slurm_cpu``: the learner on n1, the rollout roles on
n2) on ``tools/local_slurm.sh``'s cluster in BASE; the launcher's kill is ``scontrol requeue`` and
a job that leaves the queue unfinished is submitted again. A fault counts as
recovered when the ledger holds an iteration whose records were all committed after the fault
(generated and trained again: a resumed run re-trains iterations it had committed before without any
rollout, and the iteration in flight at the fault may not have needed what failed). Every fault and
recovery goes to ``OUT/chaos.jsonl`` with its times. The last line:

    CHAOS faults=N kinds=K recovered=R lost_steps=0 double_trained=0 finished=1 success=S ...

Fault kinds: ``kill_server``, ``kill_worker``, ``kill_learner``, ``kill_launcher`` (SIGKILL);
``stop_server``, ``stop_worker`` (SIGSTOP for ``--stop`` s, longer than the run's request
timeout, then SIGCONT); ``kill_in_recovery`` (a server killed, then its replacement killed as soon
as it publishes); ``corrupt_checkpoint`` (bytes of the newest checkpoint's largest file overwritten,
then the launcher killed so the next launch must load one); ``corrupt_shard`` (a committed shard of
an iteration at least two beyond the last trained one overwritten: streaming runs hold some, a sync
run none); ``disk_full`` (the run directory is
a tmpfs of ``--tmpfs-mb``; a ballast file fills it for ``--stop`` s; needs root, else the kind is
left out and said so); ``net_delay``, ``net_hole``, ``net_cut`` (the link to the server: its
published address is replaced by a TCP proxy's, which from then on carries every new connection of
the workers and the coordinator to it; for ``--stop`` s the proxy delays each chunk by 1-3 s, holds
every byte (a black hole: connections open, nothing arrives), or resets every connection, open and
new; a push caught there is cut half-way).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = (
    "kill_server",
    "kill_worker",
    "kill_learner",
    "kill_launcher",
    "stop_server",
    "stop_worker",
    "kill_in_recovery",
    "corrupt_checkpoint",
    "corrupt_shard",
    "disk_full",
    "net_delay",
    "net_hole",
    "net_cut",
)


def _reset(s: socket.socket) -> None:
    """Close ``s`` with a TCP reset, waking a thread blocked reading it."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    s.close()


def read_ready(ready: Path) -> dict:
    """A server's ready file (``{"url": ...}``); {} while there is none."""
    try:
        info = json.loads(ready.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class Proxy:
    """A TCP proxy in front of one server: forwards bytes both ways, or while a fault lasts delays
    each chunk, holds every byte (``hole``) or resets every connection (``cut``)."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.mode, self.until, self.delay = "pass", 0.0, 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def fault(self, mode: str, seconds: float, delay: float = 0.0) -> None:
        self.mode, self.until, self.delay = mode, time.time() + seconds, delay
        if mode == "cut":
            with self.lock:
                for s in list(self.conns):
                    _reset(s)

    def now(self) -> str:
        return self.mode if time.time() < self.until else "pass"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # out of descriptors for a moment: connections wait in the backlog
                time.sleep(0.1)
                continue
            if self.now() == "cut":
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            pair = [client, upstream, 0]  # the two sockets and how many directions have ended
            with self.lock:
                self.conns |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst, pair), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, pair: list) -> None:
        broken = False
        try:
            while data := src.recv(1 << 16):
                while self.now() == "hole":
                    time.sleep(0.05)
                if self.now() == "delay":
                    time.sleep(self.delay)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # the other side's end of stream, passed on
        except OSError:
            broken = True
        with self.lock:
            pair[2] += 1
            if broken or pair[2] == 2:  # both directions ended (or one broke): both sockets closed
                for s in pair[:2]:
                    _reset(s) if broken else s.close()
                self.conns -= set(pair[:2])


class Chaos:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = Path(a.out).resolve()
        self.run = self.out / "run"
        self.rng = random.Random(a.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / "chaos.jsonl").open("a")
        self.console = (self.out / "console.log").open("ab")
        self.proc: subprocess.Popen | None = None
        self.t0 = time.time()
        self.pending: list[dict] = []  # faults not yet recovered
        self.events: list[dict] = []
        self.launches = 0
        self.tmpfs = False
        self.proxies: dict[str, Proxy] = {}  # by the address it listens on
        self.job: str | None = None
        self.slurm: dict[str, str] | None = None  # the local cluster's environment (--slurm)
        if a.slurm:
            base = Path(a.slurm).resolve()
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
            subprocess.run(
                ["bash", str(ROOT / "tools/local_slurm.sh"), "start", str(base)], env=env, check=True
            )
            self.slurm = {**env, "SLURM_CONF": str(base / "etc" / "slurm.conf")}

    # ---- the run ----------------------------------------------------------------------------------
    def command(self) -> list[str]:
        a = self.a
        how = (
            ["launch", "cluster=slurm_cpu", f"cluster.time={int(a.wall // 60) + 30}"]
            if self.slurm
            else ["train"]
        )
        return [
            sys.executable, "-m", "agent_r1.cli", *how, "+experiment=quickstart",
            f"trainer.run_dir={self.run}", "trainer.progress=false", "trainer.iterations=1000000",
            f"trainer.max_wall_s={a.wall}", "trainer.checkpoint_every=5", "trainer.keep_checkpoints=3",
            "trainer.eval_every=0", f"rollout.request_timeout_s={a.request_timeout}",
            f"rollout.mode={a.mode}", *(["rollout.max_staleness=1"] if a.mode != "sync" else []),
            *a.overrides,
        ]  # fmt: skip

    def launch(self) -> None:
        self.launches += 1
        if self.slurm is None:
            self.note("launch", n=self.launches)
            self.proc = subprocess.Popen(
                self.command(), stdout=self.console, stderr=subprocess.STDOUT, start_new_session=True
            )
            return
        r = subprocess.run(self.command(), env=self.slurm, capture_output=True, text=True)
        self.console.write((r.stdout + r.stderr).encode())
        job = re.search(r"submitted job (\d+)", r.stdout)
        if r.returncode != 0 or job is None:
            raise SystemExit(f"chaos: agent-r1 launch failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        self.job = job.group(1)
        self.note("launch", n=self.launches, job=self.job)

    def ended(self) -> int | None:
        """The launcher's exit status (a Slurm job: 0 once it left the queue); None while it runs."""
        if self.slurm is None:
            return self.proc.poll()
        q = subprocess.run(["squeue", "-h", "-j", self.job], env=self.slurm, capture_output=True, text=True)
        gone = "Invalid job id" in q.stderr  # ended long enough ago for slurmctld to forget it
        return 0 if gone or (q.returncode == 0 and not q.stdout.strip()) else None  # else: unknown yet

    def launcher_running(self) -> bool:
        """The launcher runs (a Slurm job: RUNNING, not pending after a requeue)."""
        if self.slurm is None:
            return self.proc is not None and self.proc.poll() is None
        q = subprocess.run(
            ["squeue", "-h", "-j", self.job, "-o", "%T"], env=self.slurm, capture_output=True, text=True
        )
        return "RUNNING" in q.stdout

    def kill_launcher(self) -> str | None:
        """SIGKILL of the launcher; under Slurm the job is requeued (what a node failure does to a job
        submitted with --requeue: every step killed, the batch script run again)."""
        if not self.launcher_running():
            return None
        if self.slurm is not None:
            r = subprocess.run(
                ["scontrol", "requeue", self.job], env=self.slurm, capture_output=True, text=True
            )
            return f"scontrol requeue {self.job}" if r.returncode == 0 else None
        os.kill(self.proc.pid, signal.SIGKILL)
        return f"SIGKILL launcher pid {self.proc.pid}"

    def finished(self) -> bool:
        s = self.run / "summary.json"
        return s.exists() and json.loads(s.read_text()).get("budget_spent", False)

    def role_pid(self, name: str) -> int | None:
        f = self.run / "control" / "roles" / f"{name}.json"
        try:
            pid = json.loads(f.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None
        return pid if self.owned(pid) else None

    def owned(self, pid: int) -> bool:
        """``pid`` is alive and one of this run's processes (a pid is reused once it dies)."""
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except OSError:
            return False
        return str(self.run).encode() in cmd and state != "Z"

    def progress(self) -> int:
        """The last iteration the ledger holds (-1: none)."""
        try:
            lines = (self.run / "ledger.jsonl").read_text().splitlines()
        except OSError:
            return -1
        its = []
        for line in lines:
            try:
                its.append(json.loads(line)["iteration"])
            except (ValueError, KeyError):
                pass
        return max(its, default=-1)

    def trained_since(self, t: float) -> bool:
        """An iteration generated wholly after ``t`` has been trained: rollouts and updates both run
        again (a resumed run re-trains committed iterations without any rollout)."""
        try:
            lines = (self.run / "ledger.jsonl").read_text().splitlines()
        except OSError:
            return False
        for line in reversed(lines[-3:]):
            try:
                it = json.loads(line)["iteration"]
            except (ValueError, KeyError):
                continue
            metas = list((self.run / "records" / f"iter_{it:06d}").glob("shard_*.meta.json"))
            try:
                if metas and min(m.stat().st_mtime for m in metas) > t:
                    return True
            except OSError:
                continue
        return False

    def note(self, event: str, **kw) -> None:
        e = {"t": round(time.time() - self.t0, 1), "event": event, **kw}
        self.events.append(e)
        self.log.write(json.dumps(e) + "\n")
        self.log.flush()
        print(json.dumps(e), flush=True)

    # ---- faults -----------------------------------------------------------------------------------
    def signal(self, pid: int | None, sig: int) -> bool:
        if pid is None or not self.owned(pid):
            return False
        os.kill(pid, sig)
        return True

    def resume_later(self, pid: int, after: float) -> None:
        def cont() -> None:
            time.sleep(after)
            if self.owned(pid):
                os.kill(pid, signal.SIGCONT)
                self.note("sigcont", pid=pid)

        threading.Thread(target=cont, daemon=True).start()

    def inject(self, kind: str) -> str | None:
        """Inject ``kind``; what was done, or None when it has no target now."""
        roles = {"server": "server_0", "worker": "worker_0", "learner": "learner_0"}
        if kind.startswith("kill_") and kind[5:] in roles:
            pid = self.role_pid(roles[kind[5:]])
            return f"SIGKILL {roles[kind[5:]]} pid {pid}" if self.signal(pid, signal.SIGKILL) else None
        if kind == "kill_launcher":
            return self.kill_launcher()
        if kind.startswith("stop_"):
            name = roles[kind[5:]]
            pid = self.role_pid(name)
            if not self.signal(pid, signal.SIGSTOP):
                return None
            self.resume_later(pid, self.a.stop)
            return f"SIGSTOP {name} pid {pid} for {self.a.stop:.0f} s"
        if kind == "kill_in_recovery":
            pid = self.role_pid("server_0")
            if not self.signal(pid, signal.SIGKILL):
                return None
            deadline = time.time() + 120
            while time.time() < deadline:  # the replacement, as soon as it says where it is
                new = self.role_pid("server_0")
                if new is not None and new != pid:
                    os.kill(new, signal.SIGKILL)
                    return f"SIGKILL server_0 pid {pid}, then its replacement pid {new}"
                time.sleep(0.05)
            return f"SIGKILL server_0 pid {pid} (no replacement within 120 s)"
        if kind == "corrupt_checkpoint":
            ckpts = sorted(
                p for p in (self.run / "checkpoints").glob("iter_*") if (p / "checksums.json").exists()
            )
            if not ckpts or not self.launcher_running():
                return None
            big = max((p for p in ckpts[-1].rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            with big.open("r+b") as f:
                f.seek(big.stat().st_size // 2)
                f.write(os.urandom(4096))
            killed = self.kill_launcher() or "the launcher was going down already"
            return f"overwrote 4 KiB of {big.relative_to(self.run)}, then {killed}"
        if kind == "corrupt_shard":
            trained = self.progress()  # the next iteration may be read already: one beyond it
            for d in sorted((self.run / "records").glob("iter_*"), reverse=True):
                if int(d.name[5:]) > trained + 1:
                    shards = sorted(d.glob("shard_*.arrow"))
                    if shards and (d / f"{shards[0].stem}.meta.json").exists():
                        data = bytearray(shards[0].read_bytes())
                        data[len(data) // 2] ^= 0xFF
                        shards[0].write_bytes(bytes(data))
                        return f"flipped a byte of {shards[0].relative_to(self.run)} (not yet trained)"
            return None
        if kind == "disk_full":
            if not self.tmpfs:
                return None
            ballast = self.out / "run" / ".ballast"
            for part in range(20):  # what the run writes meanwhile can beat one allocation: take the rest
                st = os.statvfs(self.run)
                if st.f_bavail == 0:
                    break
                subprocess.run(
                    ["fallocate", "-l", str(st.f_bavail * st.f_frsize), f"{ballast}.{part}"],
                    capture_output=True,
                )

            def free() -> None:
                time.sleep(self.a.stop)
                for f in ballast.parent.glob(".ballast.*"):
                    f.unlink(missing_ok=True)
                self.note("disk_freed")

            threading.Thread(target=free, daemon=True).start()
            return f"filled the run's filesystem for {self.a.stop:.0f} s"
        if kind.startswith("net_"):
            return self.disturb_link(kind[4:])
        raise ValueError(kind)

    def disturb_link(self, mode: str) -> str | None:
        """Put a proxy on the link to server_0 (its published address replaced by the proxy's: every
        new connection goes through it) unless one is there, and disturb it for ``--stop`` s."""
        ready = self.run / "control" / "servers" / "server_0.json"
        pid = self.role_pid("server_0")
        info = read_ready(ready)
        url = info.get("url")
        if url is None or pid is None:
            return None
        proxy = self.proxies.get(url)
        if proxy is None:
            host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
            proxy = Proxy(host, int(port))
            self.proxies[proxy.url] = proxy
            tmp = ready.with_name(f".{ready.name}.chaos")
            tmp.write_text(json.dumps({**info, "url": proxy.url}))
            if self.role_pid("server_0") != pid or read_ready(ready).get("url") != url:
                return None  # being replaced: the replacement publishes its own address
            os.replace(tmp, ready)
        delay = self.rng.uniform(1.0, 3.0)
        proxy.fault(mode, self.a.stop, delay)
        what = {
            "delay": f"delayed every chunk {delay:.1f} s",
            "hole": "held every byte",
            "cut": "reset every connection",
        }
        return (
            f"{what[mode]} between the run and server_0 for {self.a.stop:.0f} s (proxy {proxy.url} -> "
            f"{proxy.target[0]}:{proxy.target[1]})"
        )

    # ---- the loop ---------------------------------------------------------------------------------
    def mount(self) -> None:
        if not self.a.tmpfs_mb:
            return
        self.run.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.a.tmpfs_mb}m", "tmpfs", str(self.run)],
            capture_output=True,
            text=True,
        )
        self.tmpfs = r.returncode == 0
        if not self.tmpfs:
            self.note("no_tmpfs", why=r.stderr.strip()[:200])

    def main(self) -> int:
        self.mount()
        kinds = [k for k in self.a.kinds.split(",") if k != "disk_full" or self.tmpfs]
        self.launch()
        next_fault = time.time() + self.a.first
        end_faults = self.t0 + self.a.wall
        while True:
            rc = self.ended()
            if rc is not None:
                if self.finished():
                    self.note("finished", rc=rc)
                    break
                if self.launches > self.a.max_launches:
                    self.note("gave_up", rc=rc)
                    break
                self.note("exited", rc=rc)
                time.sleep(1.0)
                self.launch()
            for f in list(self.pending):
                if self.trained_since(f["time"]):
                    self.pending.remove(f)
                    self.note(
                        "recovered", fault=f["n"], kind=f["kind"], seconds=round(time.time() - f["time"], 1)
                    )
            now = time.time()
            if now >= next_fault and now < end_faults and self.progress() >= 0:
                order = self.rng.sample(kinds, len(kinds))
                for kind in order:
                    at = self.progress()
                    what = self.inject(kind)
                    if what is not None:
                        n = sum(e["event"] == "fault" for e in self.events) + 1
                        self.pending.append({"n": n, "kind": kind, "time": now, "at_iteration": at})
                        self.note("fault", n=n, kind=kind, what=what, at_iteration=at)
                        break
                next_fault = time.time() + self.rng.uniform(*self.a.gap)
            time.sleep(0.2)
        return self.report()

    def report(self) -> int:
        audit = json.loads(
            subprocess.run(
                [sys.executable, "-m", "agent_r1.cli", "records", "audit", str(self.run)],
                capture_output=True,
                text=True,
            ).stdout.rsplit("\nAUDIT", 1)[0]
        )
        ev = subprocess.run(
            [sys.executable, "-m", "agent_r1.cli", "eval", "--run", str(self.run), "--strict", "--no-progress",
             "--out", str(self.out / "eval")],
            capture_output=True, text=True,
        )  # fmt: skip
        metrics = self.out / "eval" / "metrics.json"
        success = (
            json.loads(metrics.read_text()).get("success")
            if ev.returncode == 0 and metrics.exists()
            else None
        )
        faults = [e for e in self.events if e["event"] == "fault"]
        recovered = [e for e in self.events if e["event"] == "recovered"]
        by_kind: dict[str, list[float]] = {}
        for e in recovered:
            by_kind.setdefault(e["kind"], []).append(e["seconds"])
        summary = {
            "faults": len(faults),
            "kinds": len({e["kind"] for e in faults}),
            "recovered": len(recovered),
            "lost_steps": audit["lost_steps"],
            "double_trained": audit["double_trained"],
            "finished": int(any(e["event"] == "finished" for e in self.events)),
            "launches": self.launches,
            "iterations": audit["iterations"],
            "success": success,
            "problems": audit["problems"],
            "recovery_s": {
                k: {"n": len(v), "median": sorted(v)[len(v) // 2], "max": max(v)} for k, v in by_kind.items()
            },
        }
        (self.out / "chaos_summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        print(
            f"CHAOS faults={summary['faults']} kinds={summary['kinds']} recovered={summary['recovered']} "
            f"lost_steps={summary['lost_steps']} double_trained={summary['double_trained']} "
            f"finished={summary['finished']} launches={self.launches} iterations={summary['iterations']} "
            f"success={success}",
            flush=True,
        )
        if self.tmpfs:
            print(f"(the run directory is a tmpfs: `umount {self.run}` when done with it)")
        ok = audit["ok"] and summary["finished"] and ev.returncode == 0
        return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--wall", type=float, default=1800.0, help="faults for this long; the run's training budget"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="sync", choices=("sync", "async", "stream"))
    ap.add_argument("--out", default="runs/chaos")
    ap.add_argument("--gap", type=float, nargs=2, default=(20.0, 40.0), help="seconds between faults (range)")
    ap.add_argument("--first", type=float, default=90.0, help="seconds before the first fault")
    ap.add_argument("--stop", type=float, default=25.0, help="SIGSTOP and full-disk duration")
    ap.add_argument("--request-timeout", type=float, default=15.0, help="rollout.request_timeout_s")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument(
        "--tmpfs-mb", type=int, default=0, help="the run directory on a tmpfs this big (disk_full)"
    )
    ap.add_argument("--max-launches", type=int, default=200)
    ap.add_argument(
        "--slurm",
        metavar="BASE",
        help="run as a 2-node job (cluster=slurm_cpu) on tools/local_slurm.sh's cluster in BASE (started "
        "if needed; root): the launcher's kill is `scontrol requeue`, an unfinished job is submitted again",
    )
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for the run")
    return Chaos(ap.parse_args()).main()


if __name__ == "__main__":
    sys.exit(main())
