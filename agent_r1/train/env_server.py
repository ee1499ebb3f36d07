"""A recipe's environment as a service of the run (``rollout.env_server``): the launchers start
one ``env_server`` role (restarted when it dies, on a rollout node under Slurm) from the recipe's
``server.serve``; every worker's environments and the warm start reach it through the
``Services.env_server`` they are given (``run_env_server``). Rows get the option ``server: run``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from agent_r1.agent_tools.services import EnvServer

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


def run_env_server(cfg: Any, rd: Any, pending: bool = False) -> EnvServer | None:
    """The run's environment server (``rollout.env_server``), as its environments reach it: its
    current address, read at every episode (sessions of a server that died fail over to env_error
    after their retries). ``pending``: before the run starts it (pre-flight) — a placeholder address
    nothing is asked of before an episode's first action."""
    if not cfg.rollout.env_server:
        return None
    from recipes import load_recipe

    load_recipe(cfg.recipe.name).server()  # a recipe without a service: the error names the key
    if pending:
        return EnvServer(PENDING)
    from agent_r1.http_service import follow_published

    current = follow_published(rd.env_server_file, cfg.rollout.ready_timeout_s, "environment server")
    log.info("environments use the run's %s server at %s", cfg.recipe.name, current())
    return EnvServer(current, rd.api_key())
