"""Recipes: one folder per task with ``data.py`` (rows, demonstrations, tokenizer corpus),
``env.py`` (registers the task's agents/envs) and a README.

``load_recipe(name)`` imports both modules, so the task's agents are registered by name.
"""

from __future__ import annotations

import importlib
from types import ModuleType

RECIPES = ("arithmetic_tool", "gsm8k", "gsm8k_tool")


def load_recipe(name: str) -> ModuleType:
    """The recipe's data module, after importing its env module (which registers its agents)."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {list(RECIPES)}")
    importlib.import_module(f"recipes.{name}.env")
    return importlib.import_module(f"recipes.{name}.data")


def load_all() -> None:
    for name in RECIPES:
        load_recipe(name)
