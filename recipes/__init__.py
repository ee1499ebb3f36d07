"""Recipes: one folder per task with ``data.py`` (rows, demonstrations, tokenizer corpus),
``env.py`` (registers the task's agents/envs) and a README.

A recipe registers itself by existing: every sub-package of ``recipes/`` with a ``data.py`` is one
(adding a task edits no framework file). ``load_recipe(name)`` imports both modules, so the task's
agents are registered by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
RECIPES = tuple(
    sorted(
        m.name
        for m in pkgutil.iter_modules([str(_HERE)])
        if m.ispkg and (_HERE / m.name / "data.py").exists()
    )
)


def load_recipe(name: str) -> ModuleType:
    """The recipe's data module, after importing its env module (which registers its agents)."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {list(RECIPES)}")
    if (_HERE / name / "env.py").exists():
        importlib.import_module(f"recipes.{name}.env")
    return importlib.import_module(f"recipes.{name}.data")


def load_all() -> None:
    for name in RECIPES:
        load_recipe(name)
