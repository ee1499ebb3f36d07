"""WebShop's data files and goals, read as upstream's ``load_products`` / ``get_goals`` read them,
and an offline catalogue generated in the same layout.

Files (the public release's names): ``items_shuffle*.json`` (a JSON list of product records),
``items_ins_v2*.json`` (ASIN -> ``{attributes, instruction, instruction_attributes}``) and
``items_human_ins.json`` (ASIN -> ``[{instruction, instruction_attributes, instruction_options}]``).
Product rules as upstream: records with ASIN ``nan``, longer than 10 characters or seen before are
skipped; option names and values are lower-cased (``/`` -> `` | ``); prices parse from ``pricing``
(``$12.99`` or ``$10.99 - $15.99``; none -> 100.0, a range -> a uniform draw); a product without
attributes gets ``DUMMY_ATTR``. Goals: synthetic (one per combination of option values, the
instruction + ``with name: value, and ...``) or human; a price cap from ``PRICE_RANGE`` above the
price, appended as ``, and price lower than X dollars``.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_r1.errors import AgentR1Error

PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # 10 .. 990
FILES = ("items_shuffle.json", "items_ins_v2.json", "items_human_ins.json")
REQUIRED = ("asin", "name", "full_description", "small_description", "customization_options", "images",
            "category", "query", "product_category")  # fmt: skip


class CatalogError(AgentR1Error, ValueError):
    """A WebShop data file is missing or malformed; the message names the file, record and key."""


@dataclass
class Product:
    asin: str
    name: str  # the raw name (the type reward compares it)
    title: str
    description: str
    bullets: list[str]
    category: str
    query: str
    product_category: str
    pricing: list[float]
    price_tag: str
    options: dict[str, list[str]]
    attributes: list[str]
    instruction: str | None = None
    instruction_attributes: list[str] = field(default_factory=list)
    human: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Goal:
    asin: str
    category: str
    query: str
    name: str
    product_category: str
    instruction_text: str
    attributes: list[str]
    price_upper: float
    goal_options: dict[str, str] | list[str]
    weight: float = 1.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _read_json(path: Path, what: str) -> Any:
    if not path.exists():
        raise CatalogError(f"WebShop {what} {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CatalogError(f"{path}: not JSON ({e})") from None


def parse_pricing(pricing: Any) -> list[float]:
    if not pricing:
        return []
    out = []
    for part in str(pricing).split("$")[1:]:
        num = re.sub(r"[^0-9.]", "", part)
        if num:
            out.append(float(num))
    return out[:2]


def price_tag(prices: list[float]) -> str:
    if not prices:
        return "$100.0"
    return f"${prices[0]}" if len(prices) == 1 else f"${prices[0]} to ${prices[1]}"


def read_products(items: str | Path, attrs: str | Path, human: str | Path | None = None,
                  num_products: int | None = None) -> list[Product]:  # fmt: skip
    """The products of WebShop's files, as ``load_products`` builds them."""
    items, attrs = Path(items), Path(attrs)
    records = _read_json(items, "product file")
    if not isinstance(records, list):
        raise CatalogError(f"{items}: must be a JSON list of product records")
    attr_map = _read_json(attrs, "attribute file")
    human_map = _read_json(Path(human), "human instruction file") if human else {}
    for path, m in ((attrs, attr_map), (human, human_map)):
        if not isinstance(m, dict):
            raise CatalogError(f"{path}: must be a JSON object keyed by ASIN")
    if num_products is not None:
        records = records[:num_products]
    out, seen = [], set()
    for i, r in enumerate(records):
        where = f"{items} record {i}"
        if not isinstance(r, dict):
            raise CatalogError(f"{where}: must be an object")
        asin = r.get("asin")
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        where = f"{where} ({asin})"
        _check_product(r, where)
        seen.add(asin)
        bullets = r["small_description"]
        bullets = [bullets] if isinstance(bullets, str) else list(bullets)
        options: dict[str, list[str]] = {}
        for name, values in (r["customization_options"] or {}).items():
            if values is None:
                continue
            options[name.lower()] = [v["value"].strip().replace("/", " | ").lower() for v in values]
        prices = parse_pricing(r.get("pricing"))
        if r.get("pricing") and not prices:
            raise CatalogError(f"{where}: 'pricing' {r['pricing']!r} holds no '$' price")
        a = _instruction(attr_map, asin, attrs)
        recs = human_map.get(asin, [])
        if not isinstance(recs, list):
            raise _type_error(f"{human} {asin}", asin, "a list of instruction records", recs)
        for k, rec in enumerate(recs):
            _check_human(rec, f"{human} {asin}[{k}]")
        out.append(
            Product(
                asin=asin, name=r["name"], title=r["name"], description=r["full_description"], bullets=bullets,
                category=r["category"], query=str(r["query"]).lower().strip(), product_category=r["product_category"],
                pricing=prices, price_tag=price_tag(prices), options=options,
                attributes=list(a.get("attributes") or ["DUMMY_ATTR"]), instruction=a.get("instruction"),
                instruction_attributes=list(a.get("instruction_attributes") or []),
                human=list(human_map.get(asin, [])),
            )
        )  # fmt: skip
    if not out:
        raise CatalogError(f"{items}: no usable product")
    return out


def _type_error(where: str, key: str, want: str, got: Any) -> CatalogError:
    return CatalogError(f"{where}: {key!r} must be {want}, got {type(got).__name__} {str(got)[:60]!r}")


def _is_str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _check_product(r: dict[str, Any], where: str) -> None:
    """Every key ``load_products`` reads, with the type it reads it as."""
    missing = [k for k in REQUIRED if k not in r]
    if missing:
        raise CatalogError(f"{where}: missing key {missing[0]!r}")
    for k in ("name", "full_description", "category", "query", "product_category"):
        if not isinstance(r[k], str) or (k == "name" and not r[k].strip()):
            raise _type_error(where, k, "a non-empty string" if k == "name" else "a string", r[k])
    if not (isinstance(r["small_description"], str) or _is_str_list(r["small_description"])):
        raise _type_error(where, "small_description", "a string or a list of strings", r["small_description"])
    if not isinstance(r["images"], list) or not r["images"]:
        raise CatalogError(f"{where}: 'images' must be a non-empty list")
    pricing = r.get("pricing")
    if pricing is not None and not isinstance(pricing, str):
        raise _type_error(where, "pricing", "a string like '$12.99' or '$10.99 - $15.99'", pricing)
    opts = r["customization_options"]
    if opts is not None and not isinstance(opts, dict):
        raise _type_error(where, "customization_options", "an object of option name -> values", opts)
    for name, values in (opts or {}).items():
        if values is not None and not (
            isinstance(values, list)
            and all(isinstance(v, dict) and isinstance(v.get("value"), str) for v in values)
        ):
            raise CatalogError(f"{where}: customization_options[{name!r}] must be a list of {{'value': str}}")


def _instruction(attr_map: dict[str, Any], asin: str, path: Path) -> dict[str, Any]:
    """A product's record in ``items_ins_v2.json`` (none: ``{}``), its types checked."""
    a = attr_map.get(asin, {})
    where = f"{path} {asin}"
    if not isinstance(a, dict):
        raise _type_error(where, asin, "an object", a)
    for k in ("attributes", "instruction_attributes"):
        if a.get(k) is not None and not _is_str_list(a[k]):
            raise _type_error(where, k, "a list of strings", a[k])
    if a.get("instruction") is not None and not isinstance(a["instruction"], str):
        raise _type_error(where, "instruction", "a string", a["instruction"])
    return a


def _check_human(rec: Any, where: str) -> None:
    if not isinstance(rec, dict):
        raise _type_error(where, "instruction record", "an object", rec)
    if not isinstance(rec.get("instruction"), str):
        raise _type_error(where, "instruction", "a string", rec.get("instruction"))
    for k in ("instruction_attributes", "instruction_options"):
        if rec.get(k) is not None and not _is_str_list(rec[k]):
            raise _type_error(where, k, "a list of strings", rec[k])


def product_prices(products: list[Product], rng: random.Random) -> dict[str, float]:
    """One price per product: 100.0 without pricing, the price, or a uniform draw in a range."""
    out = {}
    for p in products:
        if not p.pricing:
            out[p.asin] = 100.0
        elif len(p.pricing) == 1:
            out[p.asin] = p.pricing[0]
        else:
            out[p.asin] = rng.uniform(*p.pricing[:2])
    return out


def _price_cap(price: float, rng: random.Random) -> tuple[float, str]:
    above = [x for x in PRICE_RANGE if x > price][:4]
    if len(above) >= 2:
        upper = max(rng.sample(above, 2))
        return upper, f", and price lower than {upper:.2f} dollars"
    return 1000000.0, ""


def _goal(p: Product, text: str, attributes: list[str], options: Any, cap: tuple[float, str]) -> Goal:
    return Goal(p.asin, p.category, p.query, p.name, p.product_category, text + cap[1],
                list(attributes), cap[0], options)  # fmt: skip


def synthetic_goals(products: list[Product], prices: dict[str, float], rng: random.Random) -> list[Goal]:
    goals: list[Goal] = []
    for p in products:
        if p.instruction is None:
            continue
        if not p.instruction_attributes:
            raise CatalogError(f"product {p.asin}: a synthetic instruction needs instruction_attributes")
        cap = _price_cap(prices[p.asin], rng)
        names = sorted(p.options)
        for combo in itertools.product(*(p.options[n] for n in names)):
            chosen = dict(zip(names, combo, strict=True))
            text = p.instruction  # as upstream: its own full stop stays, before " with ..."
            if chosen:
                text += " with " + ", and ".join(f"{n}: {v}" for n, v in chosen.items())
            goals.append(_goal(p, text, p.instruction_attributes, chosen, cap))
    counts: dict[str, int] = {}
    for g in goals:
        for a in g.attributes:
            counts[a] = counts.get(a, 0) + 1
    for g in goals:
        g.weight = sum(1.0 / counts[a] for a in g.attributes) / len(g.attributes)
    return goals


def human_goals(products: list[Product], prices: dict[str, float], rng: random.Random) -> list[Goal]:
    goals = []
    for p in products:
        for rec in p.human:
            if not rec.get("instruction_attributes"):
                continue
            cap = _price_cap(prices[p.asin], rng)
            goals.append(_goal(p, rec["instruction"].strip("."), rec["instruction_attributes"],
                               list(rec.get("instruction_options", [])), cap))  # fmt: skip
    return goals


def load_goals(folder: str | Path, human: bool = False, seed: int = 233,
               num_products: int | None = None) -> tuple[list[Product], list[Goal], dict[str, float]]:  # fmt: skip
    """Products, goals (shuffled with ``seed``, 233 upstream) and prices of a WebShop data folder.
    One price draw serves the goals' caps, the shop and the reward, as upstream's ``product_prices``
    does: two draws would price a range-priced product above the cap its own goal was given."""
    folder = Path(folder)
    items, attrs, hum = (folder / f for f in FILES)
    if not items.exists():  # the 1000-product files of the small release
        items, attrs = folder / "items_shuffle_1000.json", folder / "items_ins_v2_1000.json"
    products = read_products(items, attrs, hum if hum.exists() else None, num_products)
    rng = random.Random(seed)
    prices = product_prices(products, rng)
    goals = (human_goals if human else synthetic_goals)(products, prices, rng)
    random.Random(seed).shuffle(goals)
    return products, goals, prices


# ---- an offline catalogue in the same layout ---------------------------------------------------
KINDS = {
    # kind: (category, breadcrumb, attribute pool, options)
    "hoodie": ("fashion", "Clothing › Men › Hoodies", ["machine wash", "relaxed fit", "fleece lined", "long sleeve"],
               {"color": ["black", "navy blue", "heather grey"], "size": ["small", "medium", "large"]}),
    "mug": ("home", "Home › Kitchen › Mugs", ["dishwasher safe", "microwave safe", "ceramic", "gift box"],
            {"color": ["white", "red", "green"]}),
    "sneaker": ("fashion", "Shoes › Men › Sneakers", ["non slip", "lightweight", "breathable", "rubber sole"],
                {"size": ["8", "9", "10"], "color": ["white", "black"]}),
    "backpack": ("travel", "Bags › Backpacks", ["water resistant", "laptop sleeve", "lightweight", "usb port"],
                 {"color": ["black", "grey", "blue"]}),
    "lamp": ("home", "Home › Lighting › Lamps", ["dimmable", "led", "usb charging", "touch control"],
             {"color": ["white", "black"]}),
    "pillow": ("home", "Home › Bedding › Pillows", ["memory foam", "machine wash", "hypoallergenic", "cooling"],
               {"size": ["twin", "queen", "king"]}),
}  # fmt: skip
BRANDS = ["harbor", "summit", "cedar", "nova", "atlas", "willow", "ember", "orbit", "lumen", "pine"]


def catalog_version() -> str:
    """Changes with the generator's vocabulary: a catalogue cached on disk is rebuilt after an edit."""
    import hashlib

    return hashlib.sha256(json.dumps([KINDS, BRANDS], sort_keys=True).encode()).hexdigest()[:10]


def generate_catalog(out: str | Path, seed: int = 0, products_per_kind: int = 8) -> Path:
    """Write a seeded catalogue as WebShop's three files under ``out``: products of several kinds,
    each with its own attributes, options and price, a synthetic instruction naming two of its
    attributes, and a human instruction."""
    rng = random.Random(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    items, attrs, human = [], {}, {}
    n = 0
    for kind, (category, crumbs, pool, options) in KINDS.items():
        for _ in range(products_per_kind):
            n += 1
            asin = f"B{n:09d}"
            brand = rng.choice(BRANDS)
            mine = rng.sample(pool, 3)
            price = round(rng.uniform(8, 90), 2)
            pricing = f"${price}" if rng.random() < 0.7 else f"${price} - ${round(price * 1.3, 2)}"
            name = f"{brand.title()} {kind.title()}, {', '.join(a.title() for a in mine)}"
            items.append({
                "asin": asin, "name": name, "full_description": f"A {mine[0]} {kind} by {brand}, {mine[1]} and {mine[2]}.",
                "small_description": [f"{a.capitalize()}" for a in mine], "pricing": pricing,
                "customization_options": {o: [{"value": v, "image": None} for v in vs] for o, vs in options.items()},
                "images": [f"https://example.invalid/{asin}.jpg"], "category": category, "query": kind,
                "product_category": crumbs,
            })  # fmt: skip
            want = rng.sample(mine, 2)
            attrs[asin] = {
                "attributes": mine,
                "instruction": f"i need a {kind} that is {want[0]} and {want[1]}",
                "instruction_attributes": want,
            }
            opt = {o: rng.choice(vs) for o, vs in options.items()}
            human[asin] = [{
                "asin": asin, "instruction": f"i want a {want[0]} {kind}, {' and '.join(opt.values())}",
                "instruction_attributes": want[:1], "instruction_options": list(opt.values()),
            }]  # fmt: skip
    rng.shuffle(items)
    for name, obj in zip(FILES, (items, attrs, human), strict=True):
        (out / name).write_text(json.dumps(obj, indent=0), encoding="utf-8")
    return out
