"""Selectors: how relevant a paper is to the user's query, in [0, 1] (PaSa's selector role).

``lexical``: the fraction of the query's content words found in the paper's title and abstract;
``embedding``: cosine similarity of MiniLM embeddings, clipped to [0, 1]. Both run offline. An LLM
judge on a rollout server is the upstream choice and plugs in the same way (a registered class
with ``scores``).
"""

from __future__ import annotations

import re
from typing import Any

from agent_r1.registry import Registry

STOPWORDS = {"find", "papers", "paper", "about", "on", "the", "a", "an", "of", "for", "and", "in", "with", "to", "work", "research", "which", "what", "study", "studies", "search", "that", "are", "is", "list", "please"}  # fmt: skip
_WORD = re.compile(r"[a-z0-9]+")


def content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in STOPWORDS}


class Selector:
    def scores(self, query: str, papers: list[Any]) -> list[float]:
        raise NotImplementedError


SELECTORS: Registry[type[Selector]] = Registry("selector")


@SELECTORS.register("lexical")
class LexicalSelector(Selector):
    def scores(self, query: str, papers: list[Any]) -> list[float]:
        q = content_words(query)
        if not q:
            return [0.0] * len(papers)
        return [len(q & content_words(f"{p.title} {p.abstract}")) / len(q) for p in papers]


@SELECTORS.register("embedding")
class EmbeddingSelector(Selector):
    def __init__(self) -> None:
        from agent_r1.retrieval.index import Embedder

        self.embed = Embedder()

    def scores(self, query: str, papers: list[Any]) -> list[float]:
        if not papers:
            return []
        e = self.embed([query] + [f"{p.title}. {p.abstract}" for p in papers])
        return [float(min(max(x, 0.0), 1.0)) for x in e[1:] @ e[0]]
