"""Import stand-ins for SGLang's GPU-only dependencies, so its pure-Python modules (request types,
argument parser, process-group helper, tensor bucket) import on a CPU machine for the contract
tests. Importing this module installs a finder: ``triton``, ``torchvision``, ``tvm_ffi``,
``sgl_kernel``, ``flashinfer``, ``xgrammar`` and their submodules become permissive placeholders
(any attribute exists; a decorator returns what it decorates). Nothing of them is ever run: a
contract test that reached into one would fail on the placeholder, not pass.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

GPU_ONLY = ("triton", "torchvision", "tvm_ffi", "sgl_kernel", "flashinfer", "xgrammar")


class _PlaceholderMeta(type):
    """Placeholders are classes (``isinstance(x, triton.JITFunction)`` must work for torch, which
    sees ``triton`` importable) whose class-level operations all succeed."""

    def __getattr__(cls, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{cls.__name__}.{attr}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator (@triton.jit, @triton.autotune(...))
        return placeholder(f"{cls.__name__}()")

    def __getitem__(cls, key):
        return placeholder(f"{cls.__name__}[]")

    def __iter__(cls):
        return iter(())

    def __bool__(cls) -> bool:
        return False

    def __get_pydantic_core_schema__(cls, source, handler):  # a field typed with a stand-in
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __repr__(cls) -> str:
        return f"<stand-in {cls.__name__}>"


def placeholder(name: str) -> type:
    return _PlaceholderMeta(name, (), {})


class StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{self.__name__}.{attr}")


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...] = GPU_ONLY) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = StandInModule(spec.name)
        m.__path__ = []  # a package: submodules resolve through this finder too
        m.__version__ = "0.0.0+stand-in"
        return m

    def exec_module(self, module) -> None:
        pass


def install(names: tuple[str, ...] = GPU_ONLY) -> None:
    """Stand-ins for ``names`` (once per process)."""
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder(names))


# ``AGENT_R1_STAND_INS=triton``: only these (the megatron-core side environment's sitecustomize)
install(tuple(n for n in __import__("os").environ.get("AGENT_R1_STAND_INS", "").split(",") if n) or GPU_ONLY)
