"""reasoning-gym's procedural tasks (``pip install reasoning-gym``): any generator by name, its own
difficulty keys passed through, its own ``score_answer`` as the reward.

``recipe.options``: ``task`` (a reasoning-gym dataset name, e.g. ``basic_arithmetic``,
``chain_sum``, ``gsm_symbolic``, ``letter_counting``), ``tool`` (true: the calculator, up to 5
steps), ``system_prompt`` (one of reasoning-gym's ``SYSTEM_PROMPTS``; its ``default`` asks for the
answer in ``<answer>...</answer>``), ``examples`` (worked examples shown before every question as
earlier user and assistant turns, ``[[question, answer], ...]``: a small instruct model copies their
format; a fixed example rather than drawn items, whose answers it would copy too), and any other
key goes to the generator's config (``min_terms=2`` ...). A row is one generated item: its question as the user turn, and as its
``reward_model.ground_truth`` the task and the item itself (question, answer, metadata, as JSON),
which is all ``score_answer`` reads. Train, test and val draw from disjoint
seed ranges (item ``i`` of a split with seed ``s`` is the generator's item at seed
``s * 7919 + offset(split)``, index ``i``); a small problem space can still repeat a question across
splits.
"""

from __future__ import annotations

import json
from typing import Any

from agent_r1.data.rows import DataRow

AGENT = "reasoning_gym"
AGENT_TOOL = "reasoning_gym_tool"
TOOLS = ["calculator"]  # shown when ``tool`` is on
TOOL_HINT = "You can use the calculator tool for arithmetic."
OFFSETS = {"train": 0, "test": 1_000_003, "val": 2_000_003}  # seed ranges: an item index stays < 1e6


def _rg():
    try:
        import reasoning_gym
    except ImportError as e:  # the project installs it (pyproject); a bare environment may not
        raise ImportError(
            "the reasoning_gym recipe needs the reasoning-gym package: pip install reasoning-gym"
        ) from e
    return reasoning_gym


def _jsonable(x: Any) -> Any:
    """The item as JSON holds it (tuples become lists, sets sorted lists): what the reward reads."""
    return json.loads(
        json.dumps(x, default=lambda o: sorted(o) if isinstance(o, set | frozenset) else str(o))
    )


def ground_truth(task: str, item: dict[str, Any]) -> str:
    """What ``score_answer`` reads, as the row's ``reward_model.ground_truth`` (a string, so it
    survives the rows' public parquet layout): the task and the item (question, answer, metadata)."""
    return json.dumps({"task": task, "item": item}, sort_keys=True)


def build_rows(
    split: str = "train",
    num: int = 64,
    seed: int = 0,
    task: str = "basic_arithmetic",
    tool: bool = False,
    system_prompt: str = "default",
    examples: list[list[str]] | None = None,
    **config: Any,
) -> list[DataRow]:
    """``num`` items of reasoning-gym's ``task`` for ``split``, the generator configured by ``config``."""
    rg = _rg()
    if split not in OFFSETS:
        raise ValueError(f"recipe reasoning_gym: split must be one of {sorted(OFFSETS)}, got {split!r}")
    if num >= 1_000_000:
        raise ValueError(f"recipe reasoning_gym: at most 999999 rows per split (disjoint seeds), got {num}")
    prompts = rg.utils.SYSTEM_PROMPTS
    if system_prompt not in prompts:
        raise ValueError(f"recipe.options.system_prompt: one of {sorted(prompts)}, got {system_prompt!r}")
    if task not in rg.factory.DATASETS:
        raise ValueError(
            f"recipe.options.task: {task!r} is not a reasoning-gym dataset; e.g. {sorted(rg.factory.DATASETS)[:8]}"
        )
    try:
        ds = rg.create_dataset(task, size=num, seed=seed * 7919 + OFFSETS[split], **config)
    except TypeError as e:  # an unknown config key
        raise ValueError(f"recipe.options for reasoning-gym's {task}: {e}") from None
    system = prompts[system_prompt] + ("\n" + TOOL_HINT if tool else "")
    shots = _shots(examples or [])
    rows = []
    for i in range(num):
        item = _jsonable(ds[i])
        rows.append(
            DataRow(
                prompt=[
                    {"role": "system", "content": system},
                    *shots,
                    {"role": "user", "content": item["question"]},
                ],
                agent_name=AGENT_TOOL if tool else AGENT,
                reward_model={"style": "reasoning_gym", "ground_truth": ground_truth(task, item)},
                data_source=f"reasoning_gym/{task}",
                env_kwargs={},
                extra_info={
                    "split": split,
                    "index": i,
                    "config": json.dumps(_jsonable(config), sort_keys=True),
                },
            )
        )
    return rows


def _shots(examples: Any) -> list[dict[str, str]]:
    """``[[question, answer], ...]`` -> alternating user and assistant turns."""
    turns = []
    for i, ex in enumerate(examples):
        if not (isinstance(ex, list | tuple) and len(ex) == 2 and all(isinstance(x, str) and x for x in ex)):
            raise ValueError(
                f"recipe.options.examples[{i}]: a [question, answer] pair of non-empty strings, got {ex!r}"
            )
        turns += [{"role": "user", "content": ex[0]}, {"role": "assistant", "content": ex[1]}]
    return turns


def corpus(num: int = 200, seed: int = 0) -> list[str]:
    """Questions and answers of a few arithmetic tasks, for a tiny model's tokenizer."""
    texts = []
    for task in ("basic_arithmetic", "chain_sum", "letter_counting"):
        for r in build_rows("train", max(1, num // 3), seed, task=task):
            texts += [
                r.prompt[-1]["content"],
                f"<answer>{json.loads(r.reward_model['ground_truth'])['item']['answer']}</answer>",
            ]
    return texts
