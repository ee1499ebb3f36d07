"""Running untrusted code: each run in a child forked from a fork server that imported the usual
libraries once (pandas, numpy), under limits, in a scratch folder of its own.

What is enforced, and how (``isolation()`` says which of these this machine allows):

- **wall time**: the caller kills the run's process group at ``wall_s``;
- **CPU time, memory, file size, processes**: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``
  (stdout and stderr are files, so a huge output stops there too), ``RLIMIT_NPROC``;
- **processes cannot escape**: a PID namespace whose first process runs the code: when it ends or
  is killed, the kernel kills everything else in the namespace (a fork bomb's ``setsid`` children
  included);
- **no network**: a network namespace with no interface up (not even loopback);
- **no writes outside the scratch folder**: the code runs as an unprivileged user of its own (one
  per pool slot, so the process limit counts that run's processes alone), the scratch folder its
  only writable place besides private, size-limited ``/tmp``, ``/var/tmp`` and ``/dev/shm``
  (tmpfs in a mount namespace). It keeps the right to read (``CAP_DAC_READ_SEARCH``: Python and
  its libraries may live in a private home) and gains no privilege by ``exec``
  (``PR_SET_NO_NEW_PRIVS``).

The namespaces and the user switch need root; elsewhere the run goes on with the time, memory
and file-size limits alone (no network, write or process-count isolation), and ``isolation()``
says so (the tool logs it once).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent_r1.forkserver import ForkServer

log = logging.getLogger("agent_r1.sandbox")

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
CAP_DAC_READ_SEARCH = 2
# sandbox users (need no /etc/passwd entry): one per slot and worker process, so that a run's
# process limit counts its own processes alone
FIRST_UID = 61000 + (os.getpid() % 1000) * 64
SLOTS = 64
PRELOAD = ("pandas", "numpy")
OUT, ERR = ".stdout", ".stderr"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 2048  # address space: pandas alone maps ~600 MB
    file_mb: int = 16
    processes: int = 16
    output_chars: int = 2000

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not v > 0:
                raise ValueError(f"sandbox limit {k}: must be > 0, got {v}")


@dataclass
class RunResult:
    stdout: str
    stderr: str
    error: str | None  # None when the code ran to the end


def isolation() -> dict[str, bool]:
    """What this process can enforce besides the time, memory and file-size limits: the
    namespaces (no network, private /tmp, no escaping processes) and a user of its own per run
    (no writes outside its folder, the process limit)."""
    root = os.geteuid() == 0
    return {"namespaces": root, "own_user": root}


def preloadable(names: tuple[str, ...]) -> tuple[str, ...]:
    """The modules of ``names`` this environment has (the fork server imports them once)."""
    import importlib.util

    return tuple(n for n in names if importlib.util.find_spec(n) is not None)


# ---- in the forked child ---------------------------------------------------------------------------
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _keep_read_capability(libc: Any) -> None:
    """After the user switch: effective and permitted = CAP_DAC_READ_SEARCH only (capset v3)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    bit = 1 << CAP_DAC_READ_SEARCH
    data = (Data * 2)(Data(bit, bit, 0), Data(0, 0, 0))
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")


def _isolate(req: dict[str, Any]) -> None:
    """Namespaces (root only), then the limits, then the user switch."""
    lim = req["limits"]
    libc = _libc()
    if req["namespaces"]:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
        _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        size = f"size={lim['file_mb']}m".encode()
        for d in (b"/tmp", b"/var/tmp", b"/dev/shm"):
            if os.path.isdir(d):
                _check(libc.mount(b"tmpfs", d, b"tmpfs", 0, size), f"mount tmpfs {d.decode()}")
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (lim["file_mb"] * mb,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)
    if req["uid"] is not None:  # the limit counts the user's processes: only a user of its own
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
    if req["uid"] is not None:
        uid = req["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        _check(libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(KEEPCAPS)")
        os.setresuid(uid, uid, uid)
        _keep_read_capability(libc)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def run_code(req: dict[str, Any]) -> None:
    """The fork server's entry: the scratch folder and stdio, the isolation, then the code (in a
    PID namespace of its own where the process may create one: ``_supervise``)."""
    os.chdir(req["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, name in ((1, OUT), (2, ERR)):
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if req["uid"] is not None:
            os.fchown(f, req["uid"], req["uid"])
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.update(
        {"HOME": req["cwd"], "TMPDIR": "/tmp", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    )
    _isolate(req)
    if req["namespaces"]:
        _supervise()  # returns in the process that runs the code
    code = compile(req["code"], "<code>", "exec")
    names = {"__name__": "__main__", "__builtins__": __builtins__}
    for module, alias in (("pandas", "pd"), ("numpy", "np")):  # the preloaded, by their usual names
        if module in sys.modules:
            names[alias] = sys.modules[module]
    exec(code, names)


def _supervise() -> None:
    """The PID namespace begins with the next child, its init; the init runs the code in a child
    of its own (a namespace's init never receives the signals it has no handler for: SIGXCPU
    would not stop it), then exits with the code's status, a signal as 128 + its number. This
    process waits for the init and ends as the code ended. The init dies with this process (a
    kill -9 included), and its end takes every process of the namespace down with it."""
    init = os.fork()
    if init:
        code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
        if code > 128:  # the code died of a signal: die of it too (the caller reads it)
            sig = code - 128
            if sig != signal.SIGKILL:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os._exit(code if code >= 0 else 128 - code)
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    runner = os.fork()
    if runner == 0:
        return
    code = os.waitstatus_to_exitcode(os.waitpid(runner, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


# ---- the caller ------------------------------------------------------------------------------------
_SIGNALS = {
    signal.SIGXCPU: "CPU time limit ({cpu_s} s) exceeded",
    signal.SIGXFSZ: "file size limit ({file_mb} MB) exceeded (output or a written file too large)",
}


def _tail_error(stderr: str) -> str:
    """The last line of a traceback (``ValueError: ...``), else the end of stderr."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no error output"


def _read(path: Path, limit: int, tail: bool = False) -> str:
    """At most ``limit`` characters of a run's output file: its start (stdout), or its end
    (stderr: where a traceback says what went wrong), with a note where it was cut."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if tail:
                f.seek(max(size - 4 * limit, 0))
            data = f.read(4 * limit)
    except FileNotFoundError:
        return ""
    text = data.decode(errors="replace")
    if len(text) <= limit and len(data) == size:
        return text
    note = f"[output cut to {limit} characters]"
    return f"{note}\n{text[-limit:]}" if tail else f"{text[:limit]}\n{note}"


class Sandbox:
    """A bounded pool: at most ``pool`` runs at once in an event loop, each in a slot of its own
    (its own user, where the process may switch users)."""

    def __init__(self, limits: Limits | None = None, pool: int = 4, preload: tuple[str, ...] = PRELOAD):
        if pool < 1:
            raise ValueError(f"sandbox pool: must be >= 1, got {pool}")
        if pool > SLOTS:
            raise ValueError(f"sandbox pool: at most {SLOTS}, got {pool}")
        self.limits, self.pool, self.preload = limits or Limits(), pool, preloadable(tuple(preload))
        self.isolation = isolation()
        if not all(self.isolation.values()):
            log.warning(
                "sandbox: not root, so runs have the time, memory and file-size limits only: no "
                "network, write or process-count isolation (%s)", self.isolation
            )  # fmt: skip

    # the pool is the process's, shared by the sandboxes of every episode (tools are built per
    # episode): one semaphore per event loop and pool size, the slots process-wide
    _slots: list[int] = list(range(SLOTS))
    _guard = threading.Lock()
    _sems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        per_loop = self._sems.setdefault(asyncio.get_running_loop(), {})
        return per_loop.setdefault(self.pool, asyncio.Semaphore(self.pool))

    async def run(self, code: str, files: dict[str, str | bytes] | None = None) -> RunResult:
        async with self._semaphore():
            with self._guard:
                slot = self._slots.pop()
            try:
                return await self._run(code, files or {}, slot)
            finally:
                with self._guard:
                    self._slots.append(slot)

    async def _run(self, code: str, files: dict[str, str | bytes], slot: int) -> RunResult:
        lim = self.limits
        uid = FIRST_UID + slot if self.isolation["own_user"] else None
        workdir = Path(tempfile.mkdtemp(prefix="agent-r1-sandbox-"))
        try:
            for name, data in files.items():
                if Path(name).name != name:
                    raise ValueError(f"sandbox file {name!r}: a plain file name")
                (workdir / name).write_bytes(data.encode() if isinstance(data, str) else data)
            if uid is not None:
                for p in [workdir, *workdir.iterdir()]:
                    os.chown(p, uid, uid)
            server = await asyncio.to_thread(
                ForkServer.shared, "agent_r1.agent_tools.sandbox:run_code", self.preload
            )
            req = {
                "code": code,
                "cwd": str(workdir),
                "limits": asdict(lim),
                "uid": uid,
                "namespaces": self.isolation["namespaces"],
            }
            program = await server.start(req)
            try:
                status: int | None = await asyncio.wait_for(program.exited, lim.wall_s)
            except TimeoutError:
                status = None
            finally:
                program.stop()
            stdout = _read(workdir / OUT, lim.output_chars)
            stderr = _read(workdir / ERR, lim.output_chars, tail=True)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return RunResult(stdout, stderr, self._error(status, stderr))

    def _error(self, status: int | None, stderr: str) -> str | None:
        lim = self.limits
        if status is None:
            return f"wall time limit ({lim.wall_s:g} s) exceeded"
        if status == 0:
            return None
        if status < 0:
            sig = signal.Signals(-status)
            if sig in _SIGNALS:
                return _SIGNALS[sig].format(**asdict(lim))
            return f"killed by {sig.name}"
        last = _tail_error(stderr)
        if last.startswith("MemoryError"):
            return f"MemoryError: over the memory limit ({lim.memory_mb} MB)"
        if "File too large" in last:  # Python ignores SIGXFSZ: the write fails instead
            return _SIGNALS[signal.SIGXFSZ].format(**asdict(lim))
        if "BlockingIOError: [Errno 11] Resource temporarily unavailable" in stderr:  # a fork failed
            return f"BlockingIOError: cannot start another process (the process limit is {lim.processes})"
        return last
