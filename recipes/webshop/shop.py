"""The WebShop site as text, one session per shopper: pages, actions and observations as
upstream's ``WebAgentTextEnv`` shows them in ``text`` mode (visible strings joined by `` [SEP] ``).

Pages: search -> results (10 per page, ``Next >`` / ``< Prev``) -> item (options, ``Description``,
``Features``, ``Reviews``, ``Buy Now``) -> a sub-page (``< Prev`` back to the item) -> done.
Actions: ``search[keywords]`` (on any page) and ``click[target]`` with a target the page shows
(lower-case; an ASIN as shown). Anything else changes nothing and is reported invalid. Clicking an
option value selects it (one value per option); the options and the item are cleared when a
results page is shown or on ``back to search``. ``buy now`` scores the purchase (``reward.py``).
Search: bm25s over each product's title, description, first bullet point and options, top 50.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from recipes.webshop.catalog import Goal, Product
from recipes.webshop.reward import get_reward

PER_PAGE, TOP_N = 10, 50
_ACTION = re.compile(r"^\s*(search|click)\[(.+)\]\s*$", re.S | re.I)


class SearchEngine:
    def __init__(self, products: list[Product]):
        import bm25s

        self.products = products
        docs = [
            " ".join([p.title.lower(), p.description.lower(), (p.bullets[:1] or [""])[0].lower(),
                      ", and ".join(f"{n}: {', '.join(v)}" for n, v in p.options.items())])
            for p in products
        ]  # fmt: skip
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)

    def search(self, keywords: str) -> list[Product]:
        import bm25s

        toks = bm25s.tokenize([keywords], stopwords="en", show_progress=False)
        if not toks.ids or not toks.ids[0]:
            return []
        k = min(TOP_N, len(self.products))
        docs, scores = self.bm25.retrieve(toks, k=k, show_progress=False)
        return [self.products[int(d)] for d, s in zip(docs[0], scores[0], strict=True) if s > 0]


@dataclass
class Session:
    """One shopper's state (the upstream ``SimServer`` session)."""

    goal: Goal
    page: str = "search"  # search | results | item | description | features | reviews | done
    keywords: str = ""
    page_num: int = 1
    results: list[Product] = field(default_factory=list)
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    reward: float | None = None
    reward_info: dict[str, Any] = field(default_factory=dict)


class Shop:
    """The site: products, their prices and the search engine, shared by every session."""

    def __init__(self, products: list[Product], prices: dict[str, float]):
        self.products = {p.asin: p for p in products}
        self.prices = prices
        self.engine = SearchEngine(products)

    # ---- pages -----------------------------------------------------------------------------------
    def clickables(self, s: Session) -> list[str]:
        if s.page == "search":
            return []
        if s.page == "results":
            out = ["back to search"] + (["< prev"] if s.page_num > 1 else []) + ["next >"]
            return out + [p.asin.lower() for p in self._page(s)]
        if s.page == "item":
            p = self.products[s.asin]
            opts = [v for vs in p.options.values() for v in vs]
            return ["back to search", "< prev", *opts, "description", "features", "reviews", "buy now"]
        if s.page in ("description", "features", "reviews"):
            return ["back to search", "< prev"]
        return []

    def available_actions(self, s: Session) -> list[str]:
        out = ["search[<your query>]"] if s.page != "done" else []
        return out + [f"click[{c}]" for c in self.clickables(s)]

    def _page(self, s: Session) -> list[Product]:
        return s.results[(s.page_num - 1) * PER_PAGE : s.page_num * PER_PAGE]

    def observation(self, s: Session) -> str:
        head = ["Instruction:", s.goal.instruction_text]
        if s.page == "search":
            parts = ["WebShop", *head, "Search"]
        elif s.page == "results":
            parts = [*head, "Back to Search", f"Page {s.page_num} (Total results: {len(s.results)})"]
            parts += (["< Prev"] if s.page_num > 1 else []) + ["Next >"]
            for p in self._page(s):
                parts += [p.asin, p.title, p.price_tag]
        elif s.page == "item":
            p = self.products[s.asin]
            parts = [*head, "Back to Search", "< Prev"]
            for name, values in p.options.items():
                parts += [name, *values]
            parts += [
                p.title,
                f"Price: {p.price_tag}",
                "Rating: N.A.",
                "Description",
                "Features",
                "Reviews",
                "Buy Now",
            ]
        elif s.page in ("description", "features", "reviews"):
            p = self.products[s.asin]
            body = {"description": [p.description], "features": p.bullets, "reviews": []}[s.page]
            parts = [*head, "Back to Search", "< Prev", *body]
        else:
            parts = ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", f"{s.reward}"]
        return " [SEP] ".join(parts)

    @staticmethod
    def state_key(s: Session) -> str:
        """The page a shopper is on, for GiGPO's step groups: the same page with the same choices
        is the same state (the instruction is the group's, so it is left out)."""
        extra = f"|{sorted(s.options.items())}" if s.page == "item" else ""
        return f"{s.page}|{s.keywords}|{s.page_num}|{s.asin}{extra}"

    # ---- actions ---------------------------------------------------------------------------------
    def step(self, s: Session, action: str) -> tuple[bool, str]:
        """Apply ``action``; (valid, a message when not). Invalid actions change nothing."""
        if s.page == "done":
            return False, "the purchase is done"
        m = _ACTION.match(action or "")
        if not m:
            return False, f"not an action: {action!r} (use search[...] or click[...])"
        kind, arg = m.group(1).lower(), m.group(2).strip().lower()
        if kind == "search":
            if not arg:
                return False, "search[] needs keywords"
            s.keywords, s.page_num, s.results = arg, 1, self.engine.search(arg)
            self._to_results(s)
            return True, ""
        if arg == "search" or arg not in self.clickables(s):
            return False, f"click[{arg}] is not on this page"
        p = self.products.get(s.asin or "")
        if arg == "back to search":
            s.page, s.asin, s.options, s.keywords, s.results = "search", None, {}, "", []
        elif arg == "next >":
            s.page_num += 1
            self._to_results(s)
        elif arg == "< prev":
            if s.page == "results":
                s.page_num = max(1, s.page_num - 1)
                self._to_results(s)
            elif s.page == "item":
                self._to_results(s)
            else:
                s.page = "item"
        elif s.page == "results":
            s.asin, s.page = arg.upper(), "item"
        elif arg in ("description", "features", "reviews"):
            s.page = arg
        elif arg == "buy now":
            s.reward, s.reward_info = get_reward(p, s.goal, self.prices[p.asin], s.options)
            s.page = "done"
        else:  # an option value
            for name, values in p.options.items():
                if arg in values:
                    s.options[name] = arg
                    break
        return True, ""

    @staticmethod
    def _to_results(s: Session) -> None:
        s.page, s.asin, s.options = "results", None, {}
