"""The webshop recipe: WebShop's files read from small hand-written ones in the public layout,
goals as upstream builds them, the reward worked by hand (type, attribute, option, price cases and
upstream's quirks), the site's pages and actions, the oracle winning every goal through the agent,
and GiGPO's step groups on a replayed group."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent.tool_calls import format_tool_call
from agent_r1.agent.types import SamplingParams
from recipes import load_recipe

D = load_recipe("webshop").data
from recipes.webshop.catalog import CatalogError, Goal, human_goals, read_products, synthetic_goals  # noqa: E402
from recipes.webshop.reward import get_reward, normalize_color  # noqa: E402
from recipes.webshop.shop import Session, Shop  # noqa: E402


def _record(asin, name="Harbor Trail Men's Fleece Pullover Hoodie", **kw):
    r = {
        "asin": asin, "name": name, "full_description": "Warm hoodie. Machine wash cold.",
        "small_description": ["Machine wash cold", "Relaxed fit with ribbed cuffs"], "pricing": "$24.99 - $32.99",
        "customization_options": {"Color": [{"value": "Navy Blue", "image": None}, {"value": "Heather/Grey", "image": None}],
                                  "Size": [{"value": "Small", "image": None}, {"value": "X-Large", "image": None}]},
        "images": ["https://example.invalid/a.jpg"], "category": "fashion", "query": "Hoodies ",
        "product_category": "Clothing, Shoes & Jewelry › Men › Clothing › Hoodies", "brand": "dropped",
    }  # fmt: skip
    r.update(kw)
    return r


@pytest.fixture
def files(tmp_path):
    items = [
        _record("B0WSDEMO01"),
        _record("nan"),  # skipped
        _record("B0WSDEMO01TOOLONG"),  # skipped: longer than 10
        _record("B0WSDEMO01", name="duplicate"),  # skipped: seen
        _record("B0WSMUG002", name="Ceramic Coffee Mug", pricing="$12.00", small_description="Dishwasher safe",
                customization_options=None, query="mugs", product_category="Home › Kitchen › Mugs"),
    ]  # fmt: skip
    attrs = {
        "B0WSDEMO01": {"attributes": ["machine wash", "relaxed fit"], "instruction": "i need a relaxed fit hoodie.",
                       "instruction_attributes": ["relaxed fit", "machine wash"]},
        "B0WSMUG002": {"attributes": [], "instruction": "i want a coffee mug", "instruction_attributes": ["dishwasher safe"]},
    }  # fmt: skip
    human = {"B0WSDEMO01": [
        {"asin": "B0WSDEMO01", "instruction": "hoodie for men in navy blue, size x-large.",
         "instruction_attributes": ["relaxed fit"], "instruction_options": ["navy blue", "x-large"]},
        {"asin": "B0WSDEMO01", "instruction": "no attributes", "instruction_attributes": [], "instruction_options": []},
        {"asin": "B0WSDEMO01", "instruction": "...a warm hoodie..", "instruction_attributes": ["machine wash"],
         "instruction_options": []},
    ]}  # fmt: skip
    for name, obj in (
        ("items_shuffle.json", items),
        ("items_ins_v2.json", attrs),
        ("items_human_ins.json", human),
    ):
        (tmp_path / name).write_text(json.dumps(obj))
    return tmp_path


def test_products_as_upstream_reads_them(files):
    ps = read_products(
        files / "items_shuffle.json", files / "items_ins_v2.json", files / "items_human_ins.json"
    )
    assert [p.asin for p in ps] == ["B0WSDEMO01", "B0WSMUG002"]
    hoodie, mug = ps
    assert hoodie.options == {"color": ["navy blue", "heather | grey"], "size": ["small", "x-large"]}
    assert (
        hoodie.pricing == [24.99, 32.99]
        and hoodie.price_tag == "$24.99 to $32.99"
        and hoodie.query == "hoodies"
    )
    assert mug.bullets == ["Dishwasher safe"] and mug.options == {} and mug.price_tag == "$12.0"
    assert mug.attributes == ["DUMMY_ATTR"]  # an empty attribute list
    assert len(hoodie.human) == 3


def test_goals_as_upstream_builds_them(files):
    ps = read_products(
        files / "items_shuffle.json", files / "items_ins_v2.json", files / "items_human_ins.json"
    )
    prices = {"B0WSDEMO01": 25.0, "B0WSMUG002": 12.0}
    goals = synthetic_goals(ps, prices, random.Random(0))
    assert len(goals) == 2 * 2 + 1  # every combination of option values; one goal without options
    g = goals[0]
    assert g.instruction_text.startswith(
        # upstream's f"{instruction_text}{option_text}{price_text}": the instruction's full stop stays
        "i need a relaxed fit hoodie. with color: navy blue, and size: small, and price lower than "
    )
    assert g.price_upper in (40.0, 50.0, 60.0) and g.instruction_text.endswith(f"{g.price_upper:.2f} dollars")
    assert g.goal_options == {"color": "navy blue", "size": "small"}
    assert goals[-1].instruction_text.startswith("i want a coffee mug, and price lower than")
    # weight: the mean of 1 / (goals carrying the attribute) over the goal's attributes
    assert g.weight == pytest.approx(0.25) and goals[-1].weight == pytest.approx(1.0)
    hg = human_goals(ps, prices, random.Random(0))
    assert len(hg) == 2 and hg[0].goal_options == ["navy blue", "x-large"]  # no attributes: skipped
    # upstream's product['instruction'].strip('.'): dots go at both ends
    assert hg[0].instruction_text.startswith(
        "hoodie for men in navy blue, size x-large, and price lower than"
    )
    assert hg[1].instruction_text.startswith("a warm hoodie, and price lower than")


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda r: r.pop("query"), "record 0 (B0WSDEMO01): missing key 'query'"),
        (lambda r: r.update(images=[]), "record 0 (B0WSDEMO01): 'images' must be a non-empty list"),
        (lambda r: r.update(name=None), "record 0 (B0WSDEMO01): 'name' must be a non-empty string, got NoneType"),
        (lambda r: r.update(pricing=24.99), "'pricing' must be a string like '$12.99'"),
        (lambda r: r.update(pricing="about twenty"), "'pricing' 'about twenty' holds no '$' price"),
        (lambda r: r.update(small_description=5), "'small_description' must be a string or a list of strings"),
        (lambda r: r.update(customization_options=["Color"]), "'customization_options' must be an object"),
        (lambda r: r.update(customization_options={"Color": [{"image": None}]}),
         "customization_options['Color'] must be a list of {'value': str}"),
        (lambda r: r.update(category=["fashion"]), "'category' must be a string, got list"),
    ],
)  # fmt: skip
def test_malformed_product_files_name_record_and_key(files, mutate, says):
    items = json.loads((files / "items_shuffle.json").read_text())
    mutate(items[0])
    (files / "items_shuffle.json").write_text(json.dumps(items))
    with pytest.raises(CatalogError) as e:
        read_products(files / "items_shuffle.json", files / "items_ins_v2.json")
    assert str(files / "items_shuffle.json") in str(e.value) and says in str(e.value)


@pytest.mark.parametrize(
    ("name", "mutate", "says"),
    [
        ("items_ins_v2.json", lambda a: a["B0WSDEMO01"].update(attributes="machine wash"),
         "B0WSDEMO01: 'attributes' must be a list of strings, got str"),
        ("items_ins_v2.json", lambda a: a["B0WSDEMO01"].update(instruction=["x"]), "'instruction' must be a string"),
        ("items_ins_v2.json", lambda a: a.__setitem__("B0WSDEMO01", "x"), "'B0WSDEMO01' must be an object"),
        ("items_human_ins.json", lambda h: h["B0WSDEMO01"][0].update(instruction_options="navy blue"),
         "B0WSDEMO01[0]: 'instruction_options' must be a list of strings"),
        ("items_human_ins.json", lambda h: h.__setitem__("B0WSDEMO01", {"x": 1}), "must be a list of instruction records"),
        ("items_human_ins.json", lambda h: h.clear() or h.update(x=[]) or None, None),  # a valid file: no error
    ],
)  # fmt: skip
def test_malformed_instruction_files_name_file_asin_and_key(files, name, mutate, says):
    obj = json.loads((files / name).read_text())
    mutate(obj)
    (files / name).write_text(json.dumps(obj))
    args = (files / "items_shuffle.json", files / "items_ins_v2.json", files / "items_human_ins.json")
    if says is None:
        assert len(read_products(*args)) == 2
        return
    with pytest.raises(CatalogError) as e:
        read_products(*args)
    assert str(files / name) in str(e.value) and says in str(e.value)


# ---- the reward, by hand ----------------------------------------------------------------------
def _goal(**kw):
    g = dict(asin="B0WSDEMO01", category="fashion", query="hoodies", name="Harbor Trail Men's Fleece Pullover Hoodie",
             product_category="Clothing, Shoes & Jewelry › Men › Clothing › Hoodies", instruction_text="...",
             attributes=["relaxed fit", "machine wash"], price_upper=40.0,
             goal_options={"color": "navy blue", "size": "small"})  # fmt: skip
    g.update(kw)
    return Goal(**g)


@pytest.fixture
def hoodie(files):
    return read_products(files / "items_shuffle.json", files / "items_ins_v2.json")[0]


def test_reward_cases_by_hand(hoodie, files):
    mug = read_products(files / "items_shuffle.json", files / "items_ins_v2.json")[1]
    right = {"color": "navy blue", "size": "small"}
    # everything matches: (2 attributes + 2 options + price) / 5
    assert get_reward(hoodie, _goal(), 25.0, right)[0] == 1.0
    # one wrong option: (2 + 1 + 1) / 5
    assert get_reward(hoodie, _goal(), 25.0, {"color": "navy blue", "size": "x-large"})[0] == pytest.approx(
        0.8
    )
    # over the price cap: (2 + 2 + 0) / 5
    assert get_reward(hoodie, _goal(), 45.0, right)[0] == pytest.approx(0.8)
    # an attribute the product lacks but its description names counts (substring fallback)
    r, info = get_reward(hoodie, _goal(attributes=["relaxed fit", "machine wash cold"]), 25.0, right)
    assert r == 1.0 and info["r_att"] == 1.0
    # an attribute found nowhere: (1 + 2 + 1) / 5
    assert get_reward(hoodie, _goal(attributes=["relaxed fit", "waterproof"]), 25.0, right)[
        0
    ] == pytest.approx(0.8)
    # another kind of product: no noun of the goal's title in common -> r_type 0 -> 0 whatever else
    r, info = get_reward(mug, _goal(), 12.0, {})
    assert r == 0.0 and info["title_score"] == 0.0 and not info["query_match"]
    # a title sharing some nouns, another breadcrumb and query: r_type 0.5 when the title score is <= 0.2
    other = _goal(name="Harbor Fleece Blanket Throw Pillow Sofa Cover", query="blankets",
                  product_category="Home › Bedding")  # fmt: skip
    r, info = get_reward(hoodie, other, 25.0, right)
    assert info["title_score"] == pytest.approx(2 / 7) and info["r_type"] == 1.0  # > 0.2: kept
    other = _goal(
        name="Harbor Blanket Throw Pillow Sofa Cover Quilt Set",
        query="blankets",
        product_category="Home › Bedding",
    )
    r, info = get_reward(hoodie, other, 25.0, right)
    assert info["title_score"] == pytest.approx(1 / 7) and info["r_type"] == 0.5 and r == pytest.approx(0.5)


def test_option_quirks_copied_from_upstream(hoodie):
    # token_set_ratio is 100 when one side's tokens are a subset: a goal "x-large" matches "large"
    assert get_reward(hoodie, _goal(goal_options=["large"]), 25.0, {"size": "x-large"})[1]["r_option"] == 1.0
    # colours normalise to the first colour word they contain: "navy blue" -> "blue"
    assert normalize_color("navy blue") == "blue" and normalize_color("heather | grey") == "grey"
    # a synthetic goal's (name, value) pair: any shade of the family passes ("heather | grey" for "stone grey")
    r = get_reward(hoodie, _goal(goal_options={"color": "stone grey"}), 25.0, {"color": "heather | grey"})[1]
    assert r["r_option"] == 1.0
    # ... but a human goal's plain value is normalised itself: "stone grey" -> "grey" == "grey"
    assert (
        get_reward(hoodie, _goal(goal_options=["stone grey"]), 25.0, {"color": "heather | grey"})[1][
            "r_option"
        ]
        == 1.0
    )
    assert get_reward(hoodie, _goal(goal_options=["small"]), 25.0, {"size": "x-large"})[1]["r_option"] == 0.0


def test_colours_and_fuzzy_scores_are_upstreams(hoodie):
    from recipes.webshop.reward import COLOR_SET, ratio

    assert len(COLOR_SET) == 102 and COLOR_SET.index("aqua") < COLOR_SET.index("blue")
    # the first colour of upstream's list that the value contains: different shades stay different
    assert normalize_color("aqua blue") == "aqua" and normalize_color("navy blue") == "blue"
    r = get_reward(hoodie, _goal(goal_options=["navy blue"]), 25.0, {"color": "aqua blue"})[1]
    assert r["r_option"] == 0.0
    # thefuzz's scores: an integer, code points 128-255 dropped before comparing ("crme brle")
    assert ratio("crème brûlée", "creme brulee") == 86 and isinstance(ratio("a", "b"), int)
    assert ratio("Relaxed-Fit", "relaxed fit") == 100


def test_a_range_priced_product_is_priced_once(files):
    """Upstream draws one price per range-priced product (``product_prices``) and uses it for the
    goal's cap, the shop and the reward: the goal's own product, bought with its options, scores 1.0."""
    items = [_record(f"B0WSRANGE{i}", pricing="$10.00 - $90.00") for i in range(8)]
    attrs = {r["asin"]: {"attributes": ["machine wash", "relaxed fit"], "instruction": "i need a relaxed fit hoodie.",
                         "instruction_attributes": ["relaxed fit", "machine wash"]} for r in items}  # fmt: skip
    (files / "items_shuffle.json").write_text(json.dumps(items))
    (files / "items_ins_v2.json").write_text(json.dumps(attrs))
    (files / "items_human_ins.json").write_text("{}")
    products, goals, prices = D.catalog(str(files))
    by_asin = {p.asin: p for p in products}
    assert len(goals) == 8 * 4 and len({round(prices[a], 6) for a in by_asin}) == 8  # drawn, not fixed
    shop = Shop(products, prices)
    for g in goals:
        assert 10.0 <= prices[g.asin] <= 90.0 and prices[g.asin] <= g.price_upper
        assert get_reward(by_asin[g.asin], g, prices[g.asin], g.goal_options)[0] == 1.0
        s = Session(g)  # the oracle shopping on the site: its purchase scores 1.0 on every goal
        for action in D.oracle(g, shop):
            shop.step(s, action)
        assert s.page == "done" and s.reward == 1.0, (g.instruction_text, s.reward_info)


# ---- the site ---------------------------------------------------------------------------------
def test_pages_actions_and_invalid_clicks(hoodie):
    shop = Shop([hoodie], {hoodie.asin: 25.0})
    s = Session(_goal(instruction_text="find the hoodie"))
    assert shop.observation(s) == "WebShop [SEP] Instruction: [SEP] find the hoodie [SEP] Search"
    assert shop.step(s, "click[buy now]") == (False, "click[buy now] is not on this page")
    assert shop.step(s, "buy it")[0] is False and s.page == "search"  # nothing changed
    assert shop.step(s, "search[fleece hoodie]") == (True, "")
    assert shop.observation(s) == (
        "Instruction: [SEP] find the hoodie [SEP] Back to Search [SEP] Page 1 (Total results: 1) [SEP] Next > "
        "[SEP] B0WSDEMO01 [SEP] Harbor Trail Men's Fleece Pullover Hoodie [SEP] $24.99 to $32.99"
    )
    assert shop.step(s, "click[b0wsdemo01]")[0] and s.page == "item"
    assert "click[navy blue]" in shop.available_actions(s) and "click[< prev]" in shop.available_actions(s)
    shop.step(s, "click[navy blue]")
    shop.step(s, "click[features]")
    assert shop.observation(s).endswith("< Prev [SEP] Machine wash cold [SEP] Relaxed fit with ribbed cuffs")
    shop.step(s, "click[< prev]")
    assert s.page == "item" and s.options == {"color": "navy blue"}  # a sub-page keeps the choices
    shop.step(s, "click[< prev]")
    assert s.page == "results" and s.options == {} and s.asin is None  # a results page clears them
    shop.step(s, "click[b0wsdemo01]")
    shop.step(s, "click[navy blue]")
    shop.step(s, "click[small]")
    shop.step(s, "click[buy now]")
    assert s.page == "done" and s.reward == 1.0
    assert shop.step(s, "search[more]") == (False, "the purchase is done")


def test_oracle_wins_every_goal_through_the_agent(codec):
    rows = D.build_rows("test", None, 0)
    assert len(rows) == D.TEST_GOALS and all(r.agent_name == "webshop" for r in rows)
    flow = FlowConfig(
        max_steps=15, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )

    async def run(row, script, tid):
        return (
            await AGENTS.get(row.agent_name)
            .build(ScriptedPolicy(codec, script), codec, flow)
            .run(row, tid, "g")
        )

    async def run_all():
        demos = D.demonstrations(rows)
        return await asyncio.gather(
            *(run(r, d, f"t{i}") for i, (r, d) in enumerate(zip(rows, demos, strict=True)))
        )

    trajs = asyncio.run(run_all())
    assert all(t.metrics["success"] == 1.0 for t in trajs)
    last = trajs[0].steps[-1]
    assert last.reward == 10.0 and last.info["reward"]["metrics"] == {"score": 1.0}
    assert all(s.reward == 0.0 for s in trajs[0].steps[:-1])


def test_invalid_actions_cost_and_show(codec):
    row = D.build_rows("test", 1, 0)[0]
    script = [format_tool_call("env_step", {"command": "click[buy now]"}), "I will just answer.",
              format_tool_call("env_step", {"command": "search[mug]"})]  # fmt: skip
    flow = FlowConfig(
        max_steps=3, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )
    t = asyncio.run(
        AGENTS.get(row.agent_name).build(ScriptedPolicy(codec, script), codec, flow).run(row, "t", "g")
    )
    assert [s.process_reward for s in t.steps] == [[-0.1], [-0.1], [None]]
    assert "invalid action: click[buy now] is not on this page" in codec.decode(t.steps[1].obs_token_ids)
    assert t.steps[-1].done and t.steps[-1].reward == 0.0 and t.metrics["success"] == 0.0


def test_a_cut_action_costs_an_invalid_call_per_step_left(codec):
    """An action cut at ``max_action_tokens`` ends the episode (it cannot be trusted to hold a
    whole call) and pays the invalid-action penalty for every step the episode had left (at the
    first step: the flow's 3, not the env's 15): cutting itself short is no cheap way out."""
    row = D.build_rows("test", 1, 0)[0]
    script = [format_tool_call("env_step", {"command": "search[a very long query about mugs and lamps]"})]
    flow = FlowConfig(max_steps=3, max_action_tokens=8, max_obs_tokens=8192)
    t = asyncio.run(
        AGENTS.get(row.agent_name).build(ScriptedPolicy(codec, script), codec, flow).run(row, "t", "g")
    )
    (s,) = t.steps
    assert s.finish_reason == "length" and s.done and s.truncated
    assert s.reward == pytest.approx(-0.3) and t.metrics["success"] == 0.0


def test_gigpo_step_groups_are_non_trivial_on_a_replayed_group(codec):
    """Two shoppers of one goal: the oracle and a noisy one share the search page and the
    results page, so their first steps fall into step groups of size 2."""
    from agent_r1.learner.step_inputs import to_step_inputs
    from agent_r1.records.schema import records_to_table

    row = D.build_rows("test", 1, 0)[0]
    good = D.demonstrations([row])[0]
    noisy = D.demonstrations([row], wrong_rate=1.0)[0]
    flow = FlowConfig(
        max_steps=15, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )

    async def run(script, tid):
        return (
            await AGENTS.get(row.agent_name)
            .build(ScriptedPolicy(codec, script), codec, flow)
            .run(row, tid, "g")
        )

    a, b = asyncio.run(run(good, "a")), asyncio.run(run(noisy, "b"))
    assert a.steps[0].info["anchor_obs"] == b.steps[0].info["anchor_obs"]  # both start on the search page
    assert a.steps[1].info["anchor_obs"] == b.steps[1].info["anchor_obs"]  # ... and see the same results
    batch = to_step_inputs(records_to_table(a.steps + b.steps), anchors=True)
    keys = batch.inputs.anchor_key.tolist()
    sizes = [keys.count(k) for k in set(keys)]
    assert max(sizes) == 2 and sum(s for s in sizes if s >= 2) >= 4


def test_score_reward_shapes_the_purchase(codec):
    """``score_reward`` adds the purchase's score to the terminal reward (+10 stays the success
    bonus); success is still a score of 1.0."""
    import dataclasses

    row = D.build_rows("test", 1, 0)[0]
    shaped = dataclasses.replace(row, env_kwargs={**row.env_kwargs, "score_reward": 2.0})
    flow = FlowConfig(
        max_steps=15, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )

    def play(r, script):
        return asyncio.run(
            AGENTS.get(r.agent_name).build(ScriptedPolicy(codec, script), codec, flow).run(r, "t", "g")
        )

    good = play(shaped, D.demonstrations([row])[0])
    assert good.steps[-1].reward == 10.0 + 2.0 and good.metrics["success"] == 1.0
    noisy = D.demonstrations([row], wrong_rate=1.0)[0]
    plain, bent = play(row, noisy), play(shaped, noisy)
    score = bent.steps[-1].info["reward"]["metrics"]["score"]
    assert score < 1.0 and plain.steps[-1].reward == 0.0 and bent.metrics["success"] == 0.0
    assert bent.steps[-1].reward == pytest.approx(2.0 * score)


def _command(call: str) -> str:
    return json.loads(call.split("<tool_call>")[-1].split("</tool_call>")[0])["arguments"]["command"]


def test_option_noise_picks_values_the_page_shows():
    """``option_noise=1``: every option click is a value of the same option of the product the
    shopper opened (the instruction's one only by chance); the rest of the oracle's path stays."""
    from recipes.webshop.data import shop_for

    rows = D.build_rows("train", 60, 0)
    good = [[_command(c) for c in d] for d in D.demonstrations(rows)]
    noisy = [[_command(c) for c in d] for d in D.demonstrations(rows, option_noise=1.0)]
    shop = shop_for(None, 0, False)
    changed = 0
    for g, n in zip(good, noisy, strict=True):
        assert len(g) == len(n) and g[0] == n[0] and g[-1] == n[-1] == "click[buy now]"
        opened = next(
            a[len("click[") : -1].upper() for a in g if a[len("click[") : -1].upper() in shop.products
        )
        options = shop.products[opened].options
        for a, b in zip(g, n, strict=True):
            if a != b:
                changed += 1
                va, vb = a[len("click[") : -1], b[len("click[") : -1]
                assert any(va in vs and vb in vs for vs in options.values()), (a, b)
    assert changed >= 30  # most of the ~100 option clicks land on another value
    assert [[_command(c) for c in d] for d in D.demonstrations(rows, option_noise=0.0)] == good


def test_a_larger_offline_catalogue_reaches_the_env_and_its_oracle_wins(codec):
    """``products`` (per kind) sizes the offline catalogue: more goals, each row tells the env
    which catalogue it shops in, and the oracle's purchases there score 1.0 through the agent."""
    small, large = D.catalog(None, 0, False), D.catalog(None, 0, False, 12)
    assert len(large[0]) == 12 * len(small[0]) // D.PRODUCTS_PER_KIND
    # every kind has one goal per combination of its option values
    assert len(large[1]) == 12 * len(small[1]) // D.PRODUCTS_PER_KIND
    rows = D.build_rows("train", 6, 0, products=12)
    assert all(r.env_kwargs["products"] == 12 for r in rows)
    assert "products" not in D.build_rows("train", 1, 0)[0].env_kwargs  # the default stays implicit
    assert {r.extra_info["goal"]["asin"] for r in rows} <= {p.asin for p in large[0]}
    flow = FlowConfig(
        max_steps=15, max_action_tokens=400, max_obs_tokens=8192, sampling=SamplingParams(max_new_tokens=400)
    )

    async def run_all():
        return await asyncio.gather(*(
            AGENTS.get(r.agent_name).build(ScriptedPolicy(codec, d), codec, flow).run(r, f"t{i}", "g")
            for i, (r, d) in enumerate(zip(rows, D.demonstrations(rows), strict=True))
        ))  # fmt: skip

    assert all(t.metrics["success"] == 1.0 for t in asyncio.run(run_all()))
    with pytest.raises(ValueError, match="products"):
        D.catalog(None, 0, False, 0)
