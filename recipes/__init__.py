"""Recipes: one folder per task with ``data.py`` (rows, demonstrations, tokenizer corpus),
``env.py`` (registers the task's agents/envs), optionally ``server.py`` (the environment as a
service) and a README.

A recipe registers itself by existing: every sub-package of ``recipes/`` with a ``data.py`` is one
(adding a task edits no framework file). ``load_recipe(name)`` imports its env module (which
registers its agents, environments and tools), then its data module, and checks that the data
module provides what a recipe provides (``Recipe``): a missing piece is an error naming the file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

_HERE = Path(__file__).resolve().parent
RECIPES = tuple(
    sorted(
        m.name
        for m in pkgutil.iter_modules([str(_HERE)])
        if m.ispkg and (_HERE / m.name / "data.py").exists()
    )
)


class RecipeError(ValueError):
    """A recipe's data module does not provide what a recipe must; the message names the file."""


@dataclass(frozen=True)
class Recipe:
    """What a task provides, from ``recipes/<name>/data.py``:

    - ``build_rows(split, num, seed, **options) -> list[DataRow]`` and ``corpus() -> list[str]``
      (text for a tiny model's tokenizer), always;
    - ``TOOLS``: the names of the tools its prompt shows (their schemas train a tiny tokenizer);
    - ``demonstrations(rows, seed, **options)``: scripted actions for the warm start, if it has them;
    - ``passages(seed, paths, **options)``: the corpus of its search index, if its tools search.

    ``server.py``, where it exists, serves the environment (``serve(...)``); its environments reach
    the run's service through the ``Services.env_server`` they are given.
    """

    name: str
    data: ModuleType
    build_rows: Callable[..., list[Any]]
    corpus: Callable[..., list[str]]
    tools: tuple[str, ...]
    demonstrations: Callable[..., list[list[str]]] | None = None
    passages: Callable[..., Any] | None = None

    @classmethod
    def of(cls, name: str, data: ModuleType) -> Recipe:
        where = f"recipes/{name}/data.py"
        missing = [k for k in ("build_rows", "corpus", "TOOLS") if not hasattr(data, k)]
        if missing:
            raise RecipeError(
                f"{where}: a recipe defines build_rows(split, num, seed, ...), corpus() and TOOLS (the"
                f" tools its prompt shows, [] for none); missing: {', '.join(missing)}"
            )
        tools = data.TOOLS
        if not isinstance(tools, list | tuple) or not all(isinstance(t, str) for t in tools):
            raise RecipeError(f"{where}: TOOLS must be a list of tool names, got {tools!r}")
        optional = {k: getattr(data, k, None) for k in ("demonstrations", "passages")}
        for k, fn in {"build_rows": data.build_rows, "corpus": data.corpus, **optional}.items():
            if fn is not None and not callable(fn):
                raise RecipeError(f"{where}: {k} must be a function, got {type(fn).__name__}")
        return cls(name, data, data.build_rows, data.corpus, tuple(tools), **optional)

    @property
    def has_server(self) -> bool:
        return (_HERE / self.name / "server.py").exists()

    def server(self) -> ModuleType:
        """``recipes/<name>/server.py``: the environment as a service (``serve(...)``)."""
        if not self.has_server:
            raise ValueError(
                f"rollout.env_server: recipe {self.name} has no environment service (recipes/{self.name}/server.py)"
            )
        return importlib.import_module(f"recipes.{self.name}.server")

    def tool_schemas(self) -> list[dict[str, Any]]:
        from agent_r1.agent_tools import TOOLS

        return [TOOLS.get(t)().schema for t in self.tools]


def load_recipe(name: str) -> Recipe:
    """The recipe, after importing its env module (which registers its agents and tools)."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {list(RECIPES)}")
    if (_HERE / name / "env.py").exists():
        importlib.import_module(f"recipes.{name}.env")
    return Recipe.of(name, importlib.import_module(f"recipes.{name}.data"))


def load_all() -> None:
    for name in RECIPES:
        load_recipe(name)
