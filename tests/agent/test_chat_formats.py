"""Chat formats beyond ChatML: Llama 3 and Harmony codecs against tiny models built with those
templates — token ids equal ``apply_chat_template`` on multi-turn tool conversations, a tool call
round-trips, and a tool-using episode runs through ToolEnv exactly as with ChatML."""

from __future__ import annotations

import asyncio

import pytest
from scripted import ScriptedPolicy

from agent_r1.agent.chat import ChatCodec, HarmonyCodec, Llama3Codec, codec_for
from agent_r1.agent.flow import AGENTS, FlowConfig
from agent_r1.agent.tool_calls import MalformedCall, ToolCall, format_tool_call
from agent_r1.agent.types import SamplingParams
from agent_r1.agent_tools import TOOLS
from recipes import load_recipe

CALC = TOOLS.get("calculator")().schema
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Ava has 3 apples and finds 4; Bo has 2 times 5."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"name": "calculator", "arguments": {"expression": "3+4"}},
        {"name": "calculator", "arguments": {"expression": "2*5"}},
    ]},
    {"role": "tool", "name": "calculator", "content": "7"},
    {"role": "tool", "name": "calculator", "content": "10"},
    {"role": "assistant", "content": "Ava has 7; Bo has 10."},
    {"role": "user", "content": "And together?"},
]  # fmt: skip


@pytest.fixture(scope="module", params=["chatml", "llama3", "harmony"])
def fmt_model(request, tmp_path_factory):
    from agent_r1.models.tiny import build_tiny_model

    texts = load_recipe("arithmetic_tool").corpus(num=200)
    out = tmp_path_factory.mktemp(request.param) / "m"
    build_tiny_model(out, texts, [CALC], vocab_size=700, chat_format=request.param)
    return request.param, out


def test_codec_is_detected_from_the_tokenizer(fmt_model):
    fmt, path = fmt_model
    codec = ChatCodec.load(str(path))
    assert (
        codec.FORMAT == fmt
        and type(codec) is {"chatml": ChatCodec, "llama3": Llama3Codec, "harmony": HarmonyCodec}[fmt]
    )


def test_codec_ids_equal_apply_chat_template(fmt_model):
    from transformers import AutoTokenizer

    fmt, path = fmt_model
    tok = AutoTokenizer.from_pretrained(path)
    codec = codec_for(tok)
    for tools in (None, [CALC]):
        for msgs in (CONVERSATION, CONVERSATION[1:], CONVERSATION[:4]):
            for gen in (True, False):
                ref = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
                ids = codec.encode_chat(msgs, tools, add_generation_prompt=gen)
                assert codec.decode(ids) == ref
                assert ids == tok.encode(ref, add_special_tokens=False)  # message by message = whole text


@pytest.mark.parametrize("args", [{"expression": "12 * 7"}, {}, {"q": 'a; b "quoted" {x}'}])
def test_a_tool_call_round_trips(fmt_model, args):
    _, path = fmt_model
    codec = ChatCodec.load(str(path))
    ids = codec.encode_action(format_tool_call("calculator", args))  # as a demonstration writes it
    assert ids[-1] in codec.stop_token_ids
    text = codec.decode_action(ids)
    assert codec.parse_tool_calls(text) == [ToolCall("calculator", args)]
    assert codec.content(text) == ""  # nothing of the call shows as an answer


def test_malformed_calls_are_errors_not_crashes(fmt_model):
    fmt, path = fmt_model
    codec = ChatCodec.load(str(path))
    bad = {
        "chatml": '<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>',
        "llama3": '{"name": "calculator", "parameters": ',
        "harmony": '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": ',
    }[fmt]
    (call,) = codec.parse_tool_calls(bad)
    assert isinstance(call, MalformedCall) and "JSON" in call.error
    assert codec.parse_tool_calls("The answer is \\boxed{7}.") == []


def test_tool_episode_runs_in_every_format(fmt_model):
    _, path = fmt_model
    codec = ChatCodec.load(str(path))
    row = load_recipe("arithmetic_tool").build_rows(split="test", num=1, seed=0)[0]
    truth = row.reward_model["ground_truth"]
    expr = row.extra_info["expression"]
    policy = ScriptedPolicy(
        codec, [format_tool_call("calculator", {"expression": expr}), f"So \\boxed{{{truth}}}."]
    )
    flow = FlowConfig(max_action_tokens=200, max_obs_tokens=4096, sampling=SamplingParams(max_new_tokens=200))
    traj = asyncio.run(AGENTS.get(row.agent_name).build(policy, codec, flow).run(row, "t", "g"))
    assert len(traj.steps) == 2 and traj.metrics["success"] == 1.0
    s0, s1 = traj.steps
    assert s0.info["tool_calls"][0]["name"] == "calculator" and not s0.info["tool_calls"][0].get("error")
    # the second observation extends the first by the sampled action, exactly (token in, token out)
    assert (
        s1.obs_token_ids[: len(s0.obs_token_ids) + len(s0.action_token_ids)]
        == s0.obs_token_ids + s0.action_token_ids
    )
    assert s1.prefix_len == len(s0.obs_token_ids) + len(s0.action_token_ids)
    # ... then the format's closing tokens, the tool-result turn in this format, the generation prompt
    raw = (
        s0.feedback
        if codec.FORMAT != "chatml"
        else s0.feedback.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    )
    result_ids, _ = codec.encode_tool_results([("calculator", raw)])
    assert s1.obs_token_ids == (
        s0.obs_token_ids + s0.action_token_ids + codec.close_action(s0.action_token_ids) + result_ids
        + codec.generation_prompt_ids
    )  # fmt: skip


def test_an_unknown_chat_format_is_refused(tokenizer):
    class NoChat:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="chat format is none agent-r1 knows"):
        codec_for(NoChat())
