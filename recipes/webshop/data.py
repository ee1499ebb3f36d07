"""webshop: shop for what an instruction asks (WebShop's task): search, open products, pick
options, buy. Rows carry the goal; the environment (``env.py``) runs the site and scores the
purchase with WebShop's reward. Data: WebShop's own files (``recipe.options.data=DIR`` with
``items_shuffle*.json``, ``items_ins_v2*.json``, ``items_human_ins.json``; ``human: true`` for the
human instructions) or the seeded offline catalogue in the same layout. Goals are shuffled with
the seed; the first ``test_goals`` are the test split, the rest train (upstream holds out the
first 500)."""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path
from typing import Any

from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.data.rows import DataRow
from recipes.webshop.catalog import (
    Goal,
    Product,
    catalog_version,
    generate_catalog,
    load_goals,
)
from recipes.webshop.shop import PER_PAGE, Session, Shop

AGENT = "webshop"
TOOLS = ["env_step"]
SYSTEM = (
    "You are shopping on WebShop for what the instruction asks. Each step, call env_step with one "
    "action: search[keywords] or click[target], a target the page shows. Open products, choose the "
    "options the instruction names, and click[buy now] on the product that matches its attributes, "
    "options and price."
)
TEST_GOALS = 40
PRODUCTS_PER_KIND = 8  # the offline catalogue: 6 kinds x 8 products, 208 synthetic goals


@functools.lru_cache(maxsize=4)
def catalog(
    data: str | None = None, seed: int = 0, human: bool = False, products: int = PRODUCTS_PER_KIND
) -> tuple[list[Product], list[Goal], dict[str, float]]:
    """Products, shuffled goals and prices: of WebShop's files in ``data``, or of the offline
    catalogue generated with ``seed`` and ``products`` per kind (written once to a temporary
    folder and read back through the same loader)."""
    if data is None:
        if products < 1:
            raise ValueError(
                f"webshop: products (per kind of the offline catalogue) must be >= 1, got {products}"
            )
        name = f"agent_r1_webshop_catalog_{catalog_version()}_{seed}" + (
            f"_{products}" if products != PRODUCTS_PER_KIND else ""
        )
        folder = Path(tempfile.gettempdir()) / name
        if not (folder / "items_human_ins.json").exists():
            tmp = folder.with_name(folder.name + f".tmp{random.randrange(1 << 30)}")
            generate_catalog(tmp, seed, products)
            try:
                tmp.replace(folder)
            except OSError:  # another process wrote it first
                pass
        data = str(folder)
    return load_goals(data, human=human, seed=233 + seed)


def goal_to_row(goal: Goal, split: str, data: str | None, seed: int, human: bool,
                products: int = PRODUCTS_PER_KIND) -> DataRow:  # fmt: skip
    return DataRow(
        prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": goal.instruction_text}],
        agent_name=AGENT,
        reward_model={"style": "env_scored", "ground_truth": goal.asin},
        data_source="webshop",
        env_kwargs={"data": data, "seed": seed, "human": human}
        | ({"products": products} if products != PRODUCTS_PER_KIND else {}),
        extra_info={"split": split, "goal": goal.to_json()},
    )


def build_rows(split: str = "train", num: int | None = None, seed: int = 0, data: str | None = None,
               human: bool = False, test_goals: int = TEST_GOALS,
               products: int = PRODUCTS_PER_KIND) -> list[DataRow]:  # fmt: skip
    _, goals, _ = catalog(data, seed, human, products)
    chosen = goals[:test_goals] if split == "test" else goals[test_goals:]
    return [goal_to_row(g, split, data, seed, human, products) for g in chosen[:num]]


def fits(p: Product, goal: Goal, price: float) -> bool:
    """What a careful shopper can read off the results and the item page: the kind, every asked
    attribute (in the title) and the price under the cap."""
    return p.query == goal.query and set(goal.attributes) <= set(p.attributes) and price <= goal.price_upper


def oracle(goal: Goal, shop: Any) -> list[str]:
    """The actions that buy a product fitting the goal with its options: search its kind and
    attributes, page to the first result that fits (the goal's own product when none shows),
    open it, choose the options, buy."""

    keywords = " ".join([goal.query, *goal.attributes])
    results = shop.engine.search(keywords)
    asins = [p.asin for p in results]
    fitting = [p.asin for p in results if fits(p, goal, shop.prices[p.asin])]
    target = fitting[0] if fitting else goal.asin
    if target not in asins:
        keywords = shop.products[goal.asin].title.lower()
        asins = [p.asin for p in shop.engine.search(keywords)]
    if target not in asins:
        raise ValueError(f"the oracle cannot find {goal.asin} by its title")
    page = asins.index(target) // PER_PAGE
    values = (
        list(goal.goal_options.values()) if isinstance(goal.goal_options, dict) else list(goal.goal_options)
    )
    return (
        [f"search[{keywords}]"] + ["click[next >]"] * page + [f"click[{target.lower()}]"]
        + [f"click[{v}]" for v in values] + ["click[buy now]"]
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def shop_for(data: str | None, seed: int, human: bool, products: int = PRODUCTS_PER_KIND) -> Shop:
    items, _, prices = catalog(data, seed, human, products)
    return Shop(items, prices)


def demonstrations(rows: list[DataRow], seed: int = 0, wrong_rate: float = 0.0,
                   option_noise: float = 0.0) -> list[list[str]]:  # fmt: skip
    """The oracle's purchases as env_step calls. A noisy shopper: with ``wrong_rate`` it buys the
    first search result instead (often another product: a low score); with ``option_noise`` it
    picks each option of the product it opens at random among the values the page shows (right by
    chance only: a lower option score)."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        goal = Goal(**row.extra_info["goal"])
        k = row.env_kwargs
        shop = shop_for(
            k.get("data"), k.get("seed", 0), k.get("human", False), k.get("products", PRODUCTS_PER_KIND)
        )
        actions = oracle(goal, shop)
        if rng.random() < wrong_rate:
            first = shop.engine.search(" ".join([goal.query, *goal.attributes]))[0]
            actions = [actions[0], f"click[{first.asin.lower()}]", "click[buy now]"]
        elif option_noise:
            actions = _noisy_options(actions, shop, option_noise, rng)
        out.append([format_tool_call("env_step", {"command": a}) for a in actions])
    return out


def _noisy_options(actions: list[str], shop: Any, rate: float, rng: random.Random) -> list[str]:
    """``actions`` with each option click replaced, at ``rate``, by a click on a value of the same
    option drawn uniformly from the opened product's values."""
    clicked = [a[len("click[") : -1] if a.startswith("click[") else None for a in actions]
    opened = next(c.upper() for c in clicked if c and c.upper() in shop.products)
    options = shop.products[opened].options
    out = []
    for a, value in zip(actions, clicked, strict=True):
        name = next((n for n, vs in options.items() if value in vs), None)
        if name is not None and rng.random() < rate:
            a = f"click[{rng.choice(options[name])}]"
        out.append(a)
    return out


def corpus(num: int = 0, seed: int = 0) -> list[str]:
    """Tokenizer texts: pages, instructions and the oracle's actions of the catalogue."""
    from agent_r1.agent.chat import render_message, render_system
    from agent_r1.agent_tools import TOOLS as REGISTRY

    products, goals, _ = catalog(None, seed)
    shop = shop_for(None, seed, False)
    texts = []
    for p in products:
        texts += [p.title, p.description, *p.bullets, p.price_tag, p.asin, p.asin.lower()]
    rows = [goal_to_row(g, "train", None, seed, False) for g in goals[: num or len(goals)]]
    for row, demo in zip(rows, demonstrations(rows, seed), strict=True):
        texts.append(row.prompt[1]["content"])
        texts += demo

    for g in goals[:20]:
        s = Session(g)
        texts.append(shop.observation(s))
        for a in oracle(g, shop):
            shop.step(s, a)
            texts.append(shop.observation(s))
            texts += shop.available_actions(s)
    schemas = [REGISTRY.get(t)().schema for t in TOOLS]
    texts += [render_message("system", render_system(SYSTEM, schemas))] * 20
    return texts
