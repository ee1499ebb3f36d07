"""The services a process's episodes use besides the policy, built in one place: the search
tools' retriever, the models served by name (the policy, the helper models) and the recipe's
environment server. A run's worker and warm start get ``run_services``; pre-flight gets them
``pending`` (nothing asked before the run starts its roles); the commands that run episodes outside
a run get ``local_services``. Each is handed down explicitly: ``run_episodes(..., services=)`` ->
the flow -> the environment -> its tools, context manager and selector."""

from __future__ import annotations

from typing import Any

from agent_r1.agent_tools.services import Services


def run_services(cfg: Any, rd: Any, pending: bool = False) -> Services:
    """The run's services: its retriever (the role, or the index in this process), its models by
    name, its environment server. ``pending``: before the run starts its roles (pre-flight) — no
    retriever is opened and the environment server is a placeholder; models are names only."""
    from agent_r1.retrieval.client import run_retriever
    from agent_r1.rollout.served import run_models
    from agent_r1.train.env_server import run_env_server

    return Services(
        retriever=None if pending else run_retriever(cfg, rd),
        models=run_models(cfg, rd) if rd is not None else {},
        env_server=run_env_server(cfg, rd, pending=pending),
        api_key=rd.api_key() if rd is not None else None,
    )


def local_services(index: str | None, cfg: Any = None) -> Services:
    """Outside a run (eval, infer, chat, rollout): the search tools read ``index`` (``--index``),
    else the run's ``retrieval.index`` (``cfg``), in this process."""
    from agent_r1.retrieval.client import LocalRetriever, open_index

    if index:
        return Services(retriever=LocalRetriever(open_index(index)))
    if cfg is not None and cfg.retrieval.index:
        return Services(retriever=LocalRetriever(open_index(cfg.retrieval.index, cfg.retrieval.mode)))
    return Services()
