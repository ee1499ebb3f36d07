"""The services a process's episodes use besides the policy, wired in one place: the search
tools' retriever, the models served by name (the policy, the helper models) and the recipe's
environment server. A run's roles (worker, the coordinator's warm start) and its pre-flight call
``use_run_services``; the commands that run episodes outside a run call ``use_local_services``."""

from __future__ import annotations

from typing import Any


def use_run_services(cfg: Any, rd: Any, pending: bool = False) -> None:
    """This process's environments and tools use the run's services: its retriever (the role, or
    the index in this process), its models by name, its environment server. ``pending``: before
    the run starts its roles (pre-flight) — names only, nothing is waited for or asked."""
    from agent_r1.retrieval.client import use_run_retriever
    from agent_r1.rollout.served import use_run_models
    from agent_r1.train.env_server import use_pending_env_server, use_run_env_server

    if pending:
        if rd is not None:
            use_run_models(cfg, rd)
        use_pending_env_server(cfg)
        return
    use_run_retriever(cfg, rd)
    use_run_models(cfg, rd)
    use_run_env_server(cfg, rd)


def use_local_services(index: str | None, cfg: Any = None) -> None:
    """Outside a run (eval, infer, chat, rollout): the search tools read ``index`` (``--index``),
    else the run's ``retrieval.index`` (``cfg``), in this process."""
    from agent_r1.retrieval import client as retrieval

    if index:
        retrieval.set_default(retrieval.LocalRetriever(retrieval.open_index(index)))
    elif cfg is not None and cfg.retrieval.index:
        retrieval.set_default(
            retrieval.LocalRetriever(retrieval.open_index(cfg.retrieval.index, cfg.retrieval.mode))
        )
