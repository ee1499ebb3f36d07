"""WebShop's reward for a purchase (upstream ``get_reward``):

    reward = r_type * (n_attr + n_opt + r_price) / (len(goal attributes) + len(goal options) + 1)

- ``r_price``: the product's price <= the goal's cap;
- ``n_attr``: goal attributes matched by a product attribute (``token_set_ratio`` > 85), else found
  as a substring of the title, the bullet points or the description;
- ``n_opt``: goal options matched (``token_set_ratio`` > 85) by a chosen option value, colours
  normalised first (the first colour word of ``COLOR_SET`` contained wins). A synthetic goal's
  ``(name, value)`` pairs are compared as upstream compares them: as the string of the tuple;
- ``r_type``: 1, 0.5 when neither the query nor >= 2 breadcrumb segments nor the title (> 0.2)
  match, 0.1 when the title score is < 0.1, 0 when it is 0. The title score is the share of the
  goal title's nouns found in the bought title. Upstream tags nouns with spaCy's
  ``en_core_web_sm``, which cannot be installed offline; here the nouns are the title's content
  words (stop words and a few adjectives dropped) — the one deliberate difference.

Success is a reward of exactly 1.0. ``token_set_ratio`` is thefuzz's, as upstream calls it (code
points 128-255 dropped, lower-case, non-alphanumerics to spaces, the score rounded to an integer),
and ``COLOR_SET`` is upstream's ``normalize.py`` list, in its order (the first contained wins).
"""

from __future__ import annotations

import re
from typing import Any

from thefuzz import fuzz

from recipes.webshop.catalog import Goal, Product

# web_agent_site/engine/normalize.py's COLOR_SET, in its order
COLOR_SET = [
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal",
    "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite",
    "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon",
    "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha",
    "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink",
    "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger", "turquoise",
    "violet", "walnut", "wheat", "white", "wine", "yellow",
]  # fmt: skip
STOP = {"a", "an", "the", "and", "or", "for", "with", "of", "in", "on", "to", "by", "men", "mens", "men's", "women",
        "womens", "women's", "new", "pack", "set", "size", "color"}  # fmt: skip
_WORD = re.compile(r"[a-z][a-z']+")


def ratio(a: Any, b: Any) -> int:
    return fuzz.token_set_ratio(str(a), str(b))


def normalize_color(value: Any) -> Any:
    for c in COLOR_SET:
        if c in value:  # a substring of a string; membership in a (name, value) tuple
            return c
    return value


def nouns(title: str) -> list[str]:
    return [w for w in _WORD.findall(title.lower()) if w not in STOP]


def type_reward(bought: Product, goal: Goal) -> dict[str, Any]:
    query_match = bought.query == goal.query
    a = {s.strip() for s in bought.product_category.split("›")}
    b = {s.strip() for s in goal.product_category.split("›")}
    category_match = len(a & b) >= 2
    want = nouns(goal.name)
    title_score = len(set(nouns(bought.name)) & set(want)) / len(want) if want else 0.2
    r = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r = 0.5
    if title_score < 0.1:
        r = 0.1
    if title_score == 0.0:
        r = 0.0
    return {
        "r_type": r,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }


def attribute_matches(bought: Product, goal: Goal) -> int:
    text = (bought.title.lower(), " ".join(bought.bullets).lower(), bought.description.lower())
    n = 0
    for g in goal.attributes:
        if any(ratio(p, g) > 85 for p in bought.attributes) or any(g in t for t in text):
            n += 1
    return n


def option_matches(chosen: list[str], goal_options: Any) -> int:
    wanted = list(goal_options.items()) if isinstance(goal_options, dict) else list(goal_options)
    have = [normalize_color(v) for v in chosen]
    return sum(1 for g in wanted if any(ratio(v, normalize_color(g)) > 85 for v in have))


def get_reward(
    bought: Product, goal: Goal, price: float, chosen: dict[str, str]
) -> tuple[float, dict[str, Any]]:
    """The purchase's score in [0, 1] and its parts (``r_type``, ``r_att``, ``r_option``, ``r_price``)."""
    t = type_reward(bought, goal)
    n_attr = attribute_matches(bought, goal)
    n_opt = option_matches(list(chosen.values()), goal.goal_options)
    r_price = price <= goal.price_upper
    denom = len(goal.attributes) + len(goal.goal_options) + 1
    reward = t["r_type"] * (n_attr + n_opt + float(r_price)) / denom
    info = {
        **t,
        "r_att": n_attr / len(goal.attributes) if goal.attributes else None,
        "r_option": n_opt / len(goal.goal_options) if goal.goal_options else None,
        "r_price": bool(r_price),
    }
    return reward, info
