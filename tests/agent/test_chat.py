from agent_r1.agent.tool_calls import format_tool_call, format_tool_responses
from agent_r1.agent_tools import TOOLS

TOOLS_SCHEMA = [TOOLS.get("calculator")().schema]
MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Ava has 3 apples and finds 4."},
    {"role": "assistant", "content": format_tool_call("calculator", {"expression": "3+4"})},
    {"role": "user", "content": format_tool_responses(["7"])},
]


def test_codec_matches_hf_chat_template(tokenizer, codec):
    """Our per-message encoding equals the saved Jinja template rendered by transformers."""
    for tools in (None, TOOLS_SCHEMA):
        for msgs in (MSGS, MSGS[1:]):
            ref = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = codec.encode_chat(msgs, tools)
            assert codec.decode(ids) == ref
            # message-by-message tokenisation equals tokenising the whole text
            assert ids == tokenizer.encode(ref, add_special_tokens=False)


def test_stop_tokens_and_decode_action(codec):
    assert codec.im_end_id in codec.stop_token_ids
    ids = codec.encode("The answer is \\boxed{7}.") + [codec.im_end_id]
    assert codec.decode_action(ids) == "The answer is \\boxed{7}."
    assert codec.close_action(ids) == codec.turn_end_ids
    assert codec.close_action(ids[:-1]) == [codec.im_end_id] + codec.turn_end_ids


def test_tool_markup_tokens_are_atomic(codec, tokenizer):
    for t in (
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<|im_start|>",
        "<|im_end|>",
    ):
        assert codec.encode(t) == [tokenizer.convert_tokens_to_ids(t)]
