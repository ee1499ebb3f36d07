"""The project's own CPU kernels (C++ sources in this folder), built on the machine that runs them.

``load(name)`` compiles ``<name>.cpp`` (with the folder's headers) once per machine kind (g++ -O3 -march=native -fopenmp;
the library's file name hashes the source, flags, compiler and CPU, so a cache shared by different
nodes holds one build per kind of node) and returns it through ctypes. ``-fopenmp`` links
libgomp.so.1, which resolves to the OpenMP runtime torch has already loaded: a kernel shares
torch's threads and their wait policy. Where nothing can be built (no compiler) ``load`` returns
None once, with a warning, and the caller runs its PyTorch path; ``AGENT_R1_NATIVE=0`` turns every
kernel off. ``AGENT_R1_NATIVE_MARCH=haswell`` builds for another CPU than this one (with torch's
``ATEN_CPU_CAPABILITY=avx2``: an AVX2-only machine's arithmetic on a newer one).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")  # compile, with -march
# Linked apart and without -ffast-math: linking with it adds crtfastmath.o, whose constructor sets
# flush-to-zero for the whole process when the library loads (subnormal floats would then vanish
# in every library, torch and numpy included)
LINK = ("-shared", "-fopenmp")


def _flags() -> tuple[str, ...]:
    return (*FLAGS, f"-march={os.environ.get('AGENT_R1_NATIVE_MARCH') or 'native'}")


def enabled() -> bool:
    return os.environ.get("AGENT_R1_NATIVE", "1") != "0"


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The built library of ``<name>.cpp``; None where it cannot be built here (said once)."""
    if not enabled():
        return None
    try:
        return ctypes.CDLL(str(build(name)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native kernel %s unavailable (%s); using the PyTorch path", name, e)
        return None


def build(name: str) -> Path:
    """Compile ``<name>.cpp`` for this CPU and compiler once (atomic: processes building at once
    each install a whole library)."""
    source = HERE / f"{name}.cpp"
    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as e:
        raise OSError(f"no C++ compiler ({cxx}); install g++") from e
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(HERE.glob("*.h"))]
    for part in (
        source.read_bytes(),
        *headers,
        " ".join(_flags() + LINK).encode(),
        version.encode(),
        _cpu_id().encode(),
    ):
        key.update(part)
    cache = Path(os.environ.get("AGENT_R1_KERNEL_CACHE") or Path.home() / ".cache" / "agent_r1" / "kernels")
    lib = cache / f"{name}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        obj, out = Path(tmp) / f"{name}.o", Path(tmp) / lib.name
        for cmd in (
            [cxx, *_flags(), "-c", str(source), "-o", str(obj)],
            [cxx, *LINK, str(obj), "-o", str(out)],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise OSError(f"{cxx} failed to build {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(out, lib)
    log.info("built %s", lib)
    return lib


_TYPES = {"p": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_int64, "f32": ctypes.c_float}


def function(name: str, symbol: str, dtype: Any, signature: str) -> ctypes._CFuncPtr | None:
    """``<symbol>_f32`` or ``<symbol>_bf16`` (by the torch ``dtype`` it works on) of library
    ``name``; ``signature``: its arguments before the thread count (``call`` adds it), as ``p``
    (a pointer), ``i32``, ``i64`` or ``f32``. None where the dtype has no kernel or nothing is built."""
    import torch

    suffix = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype)
    lib = load(name) if suffix else None
    if lib is None:
        return None
    fn = getattr(lib, f"{symbol}_{suffix}")
    fn.argtypes, fn.restype = [*(_TYPES[t] for t in signature.split()), ctypes.c_int], None
    return fn


def forward_backward(name: str, dtype: Any, forward: str, backward: str) -> tuple[Any, Any] | None:
    """A learner kernel's pair: ``agent_r1_<name>_forward`` and ``agent_r1_<name>_backward`` of
    library ``name`` for the torch ``dtype`` (``forward`` and ``backward``: their signatures, as
    ``function`` takes them); None where either cannot be built. A learner module keeps
    ``META`` in their place for a dry run of a CPU learner (meta tensors: the same tensors, kept
    alike, no values)."""
    fwd = function(name, f"agent_r1_{name}_forward", dtype, forward)
    bwd = function(name, f"agent_r1_{name}_backward", dtype, backward)
    return None if fwd is None or bwd is None else (fwd, bwd)


META = ("meta", "meta")


def call(fn: ctypes._CFuncPtr, *args: Any) -> None:
    """Call a kernel: a tensor passes as its data pointer (the tensors stay referenced by ``args``
    for the call), None as a null pointer, a number as itself; torch's thread count goes last."""
    import torch

    tensor = torch.Tensor  # (ctypes passes an int or None to a pointer argument as the pointer)
    fn(*[a.data_ptr() if isinstance(a, tensor) else a for a in args], torch.get_num_threads())


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))}))
