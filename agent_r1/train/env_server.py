"""A recipe's environment as a service of the run (``rollout.env_server``): the launchers start
one ``env_server`` role (restarted when it dies, on a rollout node under Slurm) from the recipe's
``server.serve``; every worker's environments and the warm start talk to it through the recipe's
``use_env_server`` (the ``Recipe`` protocol). Rows get the environment option ``server: run``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def recipe_server(name: str) -> Any:
    from recipes import load_recipe

    return load_recipe(name).server()


def serve_env(cfg: Any, host: str, port: int, ready_file: Path, api_key: str | None, stop_when: Any) -> int:
    """The ``env_server`` role: the recipe's server with the run's recipe options and seed."""
    return recipe_server(cfg.recipe.name).serve(
        host, port, ready_file, api_key, stop_when, seed=cfg.recipe.seed, **dict(cfg.recipe.options)
    )


PENDING = "http://env-server.pending"  # an address for checks before the run starts its server


def use_pending_env_server(cfg: Any) -> None:
    """Preflight: environments are built against the server the run will start (nothing is asked
    of it before an episode's first action)."""
    if cfg.rollout.env_server:
        from recipes import load_recipe

        load_recipe(cfg.recipe.name).use_env_server(PENDING, None)


def use_run_env_server(cfg: Any, rd: Any) -> None:
    """This process's environments use the run's environment server (when ``rollout.env_server``)."""
    if not cfg.rollout.env_server:
        return
    from agent_r1.service import follow_published

    # sessions of a server that died fail over to env_error after their retries
    current = follow_published(rd.env_server_file, cfg.rollout.ready_timeout_s, "environment server")
    from recipes import load_recipe

    load_recipe(cfg.recipe.name).use_env_server(current, rd.api_key())
    log.info("environments use the run's %s server at %s", cfg.recipe.name, current())
