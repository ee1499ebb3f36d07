"""Selectors: how relevant a paper is to the user's query, in [0, 1] (PaSa's selector role).

``lexical``: the fraction of the query's content words found in the paper's title and abstract;
``embedding``: cosine similarity of MiniLM embeddings, clipped to [0, 1]; ``llm``: an LLM judge on
a rollout server (SGLang or ``agent-r1 serve``, any chat model): P(Yes) / (P(Yes) + P(No)) for
"is this paper relevant?", from two prefills through the same ``/generate`` the teacher uses. In a
run the judge is the helper model ``selector`` (``rollout.helpers.selector=HF_DIR``: the launcher
serves it by a ``selector`` role, on the rollout nodes of a Slurm job); ``url`` + ``tokenizer``
name a judge served elsewhere.
``scores`` may be a coroutine (the environment awaits it).
"""

from __future__ import annotations

import re
from typing import Any

from agent_r1.agent_tools.services import NO_SERVICES, Services
from agent_r1.registry import Registry

JUDGE_PROMPT = (
    "Query: {query}\nPaper: {title}. {abstract}\nIs this paper relevant to the query? Answer Yes or No."
)

STOPWORDS = {"find", "papers", "paper", "about", "on", "the", "a", "an", "of", "for", "and", "in", "with", "to", "work", "research", "which", "what", "study", "studies", "search", "that", "are", "is", "list", "please"}  # fmt: skip
_WORD = re.compile(r"[a-z0-9]+")


def content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in STOPWORDS}


class Selector:
    def __init__(self, services: Services = NO_SERVICES) -> None:
        """``services``: the environment's (a judge served by name)."""

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
    def __init__(self, services: Services = NO_SERVICES) -> None:
        from agent_r1.retrieval.index import Embedder

        self.embed = Embedder()

    def scores(self, query: str, papers: list[Any]) -> list[float]:
        if not papers:
            return []
        e = self.embed([query] + [f"{p.title}. {p.abstract}" for p in papers])
        return [float(min(max(x, 0.0), 1.0)) for x in e[1:] @ e[0]]


@SELECTORS.register("llm")
class LLMSelector(Selector):
    """An LLM judge: the run's helper model ``model`` or, with ``url`` (a server or router), the
    one served there (``tokenizer``: its HF folder)."""

    def __init__(
        self,
        url: str | None = None,
        tokenizer: str | None = None,
        model: str = "selector",
        api_key: str | None = None,
        timeout_s: float = 60.0,
        services: Services = NO_SERVICES,
    ):
        from agent_r1.agent.chat import ChatCodec

        if url and not tokenizer:
            raise ValueError("selector llm: a judge given by url needs tokenizer=HF_DIR of its model")
        self.served = None if url else services.model(model)
        self.codec = ChatCodec.load(tokenizer or self.served.model)
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.answers = [self.codec.encode(w) for w in ("Yes", "No")]

    async def _client(self) -> Any:
        from agent_r1.rollout.client import RolloutClient

        if self.served is not None:
            return await self.served.client(self.timeout_s)
        return RolloutClient(servers=[self.url], timeout_s=self.timeout_s, api_key=self.api_key)

    async def _logprob(self, client: Any, prompt: list[int], answer: list[int]) -> float:
        body = {
            "input_ids": prompt + answer,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": len(prompt),
        }
        out = await client.generate_raw(body)
        return sum(float(x[0]) for x in out["meta_info"]["input_token_logprobs"])

    async def scores(self, query: str, papers: list[Any]) -> list[float]:
        import asyncio
        import math

        client = await self._client()
        try:
            prompts = [
                self.codec.encode_chat(
                    [
                        {
                            "role": "user",
                            "content": JUDGE_PROMPT.format(query=query, title=p.title, abstract=p.abstract),
                        }
                    ]
                )
                for p in papers
            ]
            lps = await asyncio.gather(
                *(self._logprob(client, pr, a) for pr in prompts for a in self.answers)
            )
        finally:
            await client.close()
        out = []
        for yes, no in zip(lps[0::2], lps[1::2], strict=True):
            m = max(yes, no)
            out.append(math.exp(yes - m) / (math.exp(yes - m) + math.exp(no - m)))
        return out
