import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.agent.tool_calls import (
    CLOSE,
    OPEN,
    MalformedCall,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
)


def test_single_call_with_surrounding_text():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+3"})]


def test_no_call():
    assert parse_tool_calls("The answer is \\boxed{5}.") == []


def test_several_calls_in_order():
    text = (
        format_tool_call("a", {"x": 1})
        + " and "
        + format_tool_call("b", {"y": [1, 2]})
        + format_tool_call("c", {})
    )
    assert parse_tool_calls(text) == [
        ToolCall("a", {"x": 1}),
        ToolCall("b", {"y": [1, 2]}),
        ToolCall("c", {}),
    ]


def test_nested_braces_and_braces_in_strings():
    args = {"q": {"inner": {"deep": "}{"}}, "s": "a } b { c", "l": [{"k": "}"}]}
    assert parse_tool_calls(format_tool_call("search", args)) == [ToolCall("search", args)]


def test_malformed_json_reports_position():
    (c,) = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>')
    assert isinstance(c, MalformedCall) and "invalid JSON" in c.error and "position" in c.error


def test_malformed_call_does_not_hide_the_next_one():
    text = "<tool_call>{oops}</tool_call>" + format_tool_call("calculator", {"expression": "1"})
    calls = parse_tool_calls(text)
    assert isinstance(calls[0], MalformedCall)
    assert calls[1] == ToolCall("calculator", {"expression": "1"})


def test_unclosed_tag():
    (c,) = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {}}')
    assert isinstance(c, MalformedCall) and "unclosed" in c.error


def test_structure_errors():
    cases = {
        "[1, 2]": "JSON object",
        '{"arguments": {}}': '"name"',
        '{"name": 3}': '"name"',
        '{"name": "f", "arguments": [1]}': '"arguments" must be a JSON object',
        '{"name": "f", "arguments": "not json"}': "not JSON",
        '{"name": "f", "arguments": {}, "extra": 1}': "unexpected keys",
    }
    for body, msg in cases.items():
        (c,) = parse_tool_calls(f"{OPEN}{body}{CLOSE}")
        assert isinstance(c, MalformedCall), body
        assert msg in c.error, (body, c.error)


def test_arguments_as_json_string_are_accepted():
    (c,) = parse_tool_calls(f'{OPEN}{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}{CLOSE}')
    assert c == ToolCall("f", {"a": 1})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)
safe_text = st.text(max_size=60).filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=8), json_values, max_size=4)
        ),
        max_size=4,
    ),
    st.lists(safe_text, min_size=5, max_size=5),
)
def test_property_roundtrip(calls, fillers):
    text = fillers[0]
    for i, (name, args) in enumerate(calls):
        text += format_tool_call(name, args) + fillers[(i + 1) % 5]
    assert parse_tool_calls(text) == [ToolCall(n, a) for n, a in calls]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/tool_cal{}":,[] nameargs1\\')), max_size=80))
def test_property_never_raises(text):
    for c in parse_tool_calls(text):
        assert isinstance(c, (ToolCall, MalformedCall))
        if isinstance(c, ToolCall):
            assert isinstance(c.name, str) and isinstance(c.arguments, dict)


def test_format_is_hermes_json():
    s = format_tool_call("calculator", {"expression": "1+2"})
    assert s.startswith(OPEN) and s.endswith(CLOSE)
    assert json.loads(s[len(OPEN) : -len(CLOSE)]) == {
        "name": "calculator",
        "arguments": {"expression": "1+2"},
    }
