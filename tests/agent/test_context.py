import asyncio

import pytest

from agent_r1.agent.context import History, Turn, build_context


def _history(codec, n_pairs=4):
    h = History(codec.encode_system("System text that must never be cut.", None))
    h.turns.append(Turn("user", codec.encode_message("user", "the task"), "the task"))
    for i in range(n_pairs):
        a = (
            codec.generation_prompt_ids
            + codec.encode(f"thinking about step {i}")
            + [codec.im_end_id]
            + codec.turn_end_ids
        )
        h.turns.append(Turn("assistant", a, f"thinking about step {i}"))
        h.turns.append(Turn("user", codec.encode_message("user", f"result {i}"), f"result {i}"))
    return h


def test_append_sees_everything(codec):
    h = _history(codec)
    ids = build_context(codec, "append").view(h)
    assert ids == h.prefix_ids + sum((t.token_ids for t in h.turns), []) + codec.generation_prompt_ids


@pytest.mark.parametrize("budget_extra", [0, 5, 40, 100000])
def test_sliding_window_budget_keeps_prefix_and_task(codec, budget_extra):
    h = _history(codec)
    fixed = len(h.prefix_ids) + len(h.turns[0].token_ids) + len(codec.generation_prompt_ids)
    ctx = build_context(codec, "sliding_window", max_tokens=fixed + budget_extra)
    ids = ctx.view(h)
    assert len(ids) <= max(fixed + budget_extra, fixed)
    assert ids[: len(h.prefix_ids)] == h.prefix_ids  # never cut
    assert ids[len(h.prefix_ids) : len(h.prefix_ids) + len(h.turns[0].token_ids)] == h.turns[0].token_ids
    kept = ctx.select(h)
    # whole turns, newest ones, contiguous
    assert kept[0] is h.turns[0]
    assert kept[1:] == h.turns[len(h.turns) - (len(kept) - 1) :] if len(kept) > 1 else True
    if budget_extra >= 100000:
        assert kept == h.turns


def test_sliding_window_rejects_bad_budget(codec):
    with pytest.raises(ValueError, match="max_tokens"):
        build_context(codec, "sliding_window", max_tokens=0)


def test_summarize_folds_old_turns(codec):
    h = _history(codec, n_pairs=5)
    seen = []

    async def summarizer(turns):
        seen.extend(turns)
        return "folded"

    budget = h.total_tokens() - 10
    ctx = build_context(codec, "summarize", max_tokens=budget, keep_last=2, summarizer=summarizer)
    original = list(h.turns)
    asyncio.run(ctx.update(h))
    assert h.turns[0] is original[0] and h.turns[-2:] == original[-2:]
    assert seen == original[1:-2]
    assert "Summary of earlier steps:\nfolded" in h.turns[1].text
    assert h.turns[1].token_ids == codec.encode_message("user", h.turns[1].text)
    # under budget: nothing changes
    before = list(h.turns)
    asyncio.run(build_context(codec, "summarize", max_tokens=10**6).update(h))
    assert h.turns == before


def test_unknown_context_lists_known(codec):
    with pytest.raises(KeyError, match="append.*rewrite.*sliding_window.*summarize"):
        build_context(codec, "nope")


def test_summary_written_by_the_served_policy(codec, tiny_model_dir, tmp_path):
    """``summarizer=policy``: the summary turn holds the policy server's greedy continuation of
    the summarising prompt, checked against a float64 HF greedy decode of the same prompt."""
    import torch
    from rollout_servers import ServerProc
    from transformers import AutoModelForCausalLM

    from agent_r1.agent_tools.services import Services
    from agent_r1.rollout.served import ServedModel

    h = _history(codec, n_pairs=5)
    old = h.turns[1:-2]
    s = ServerProc(tiny_model_dir, tmp_path, "policy")
    try:
        services = Services(models={"policy": ServedModel("policy", str(tiny_model_dir), lambda: [s.url])})
        ctx = build_context(
            codec, "summarize", services, max_tokens=h.total_tokens() - 10, keep_last=2, summarizer="policy",
            summary_tokens=6,
        )  # fmt: skip
        asyncio.run(ctx.update(h))
    finally:
        s.kill()
    transcript = "\n".join(f"{t.role}: {t.text}" for t in old)
    prompt = codec.encode_chat(
        [
            {
                "role": "user",
                "content": "Summarise these earlier steps briefly, keeping facts and numbers:\n" + transcript,
            }
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    ids = list(prompt)
    for _ in range(6):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt in codec.stop_token_ids:
            break
    want = "Summary of earlier steps:\n" + codec.decode_action(ids[len(prompt) :])
    assert len(h.turns) == 4 and h.turns[1].text == want
    assert h.turns[1].token_ids == codec.encode_message("user", want)


def test_summary_by_an_unserved_model_fails_at_once(codec):
    with pytest.raises(ValueError, match="rollout.helpers.nobody"):
        build_context(codec, "summarize", max_tokens=100, summarizer="nobody")
