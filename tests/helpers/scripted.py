"""A scripted policy for agent-layer tests: it "samples" given texts, token for token.

The agent layer is what is under test, so the policy's output is a test input. Logprobs are
distinct per position so a test can tell whether they were kept in order.
"""

from __future__ import annotations

from agent_r1.agent.chat import ChatCodec
from agent_r1.rollout.protocol import Completion, FinishReason, SamplingParams


class ScriptedPolicy:
    def __init__(self, codec: ChatCodec, responses: list[str], version: int = 3, close: bool = True):
        self.codec, self.responses, self.version, self.close = codec, list(responses), version, close
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.images: list[list] = []  # the images each call was given (SGLang's image_data)

    async def __call__(
        self, token_ids: list[int], sampling: SamplingParams, images: list | None = None
    ) -> Completion:
        self.calls.append((list(token_ids), sampling))
        self.images.append(list(images or []))
        text = self.responses.pop(0)
        ids = self.codec.encode_action(text)  # Hermes-form calls in the codec's format, + stop
        ids = ids if self.close else ids[:-1]
        reason = FinishReason.STOP
        if len(ids) > sampling.max_new_tokens:
            ids, reason = ids[: sampling.max_new_tokens], FinishReason.LENGTH
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        return Completion(ids, logprobs, reason, self.version)


def play(codec: ChatCodec, row, script: list[str], services=None, **flow):
    """One episode of ``row`` through its registered agent with ``script`` as the policy's
    responses (``flow``: FlowConfig fields; the action budget is also the sampling budget):
    the trajectory and the policy (its calls)."""
    import asyncio

    from agent_r1.agent.flow import AGENTS, FlowConfig

    policy = ScriptedPolicy(codec, script)
    sampling = SamplingParams(max_new_tokens=flow.get("max_action_tokens", 256))
    agent = AGENTS.get(row.agent_name).build(policy, codec, FlowConfig(sampling=sampling, **flow), services)
    return asyncio.run(agent.run(row, "t", "g")), policy


def index_services(passages, out):
    """The services a run's episodes are given when its retriever is a local index of
    ``passages`` (built at ``out``)."""
    from agent_r1.agent_tools.services import Services
    from agent_r1.retrieval.client import LocalRetriever, open_index
    from agent_r1.retrieval.index import build_index

    build_index(passages, out)
    return Services(retriever=LocalRetriever(open_index(str(out))))
