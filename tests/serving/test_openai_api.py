"""The OpenAI-compatible routes of ``agent-r1 serve``, driven by the official ``openai`` client:
plain, streaming, ``n > 1``, tool calls (``tool_model``: the tiny model taught one call), tool messages rendered
as training renders them, logprobs, and OpenAI's error shape; a chat completion's tokens equal
``/generate``'s on the same prompt ids and seed."""

from __future__ import annotations

import json
import urllib.request

import pytest
from rollout_servers import ServerProc
from tool_model import ASK, CALL_TEXT

from agent_r1.agent.chat import ChatCodec
from agent_r1.agent.tool_calls import format_tool_call, format_tool_responses
from agent_r1.agent_tools import TOOLS
from agent_r1.serving.openai_api import render_messages

openai = pytest.importorskip("openai")

CALC = TOOLS.get("calculator")().schema


def generate(url: str, body: dict) -> dict:
    """SGLang's /generate on the same server."""
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    s = ServerProc(tool_model, tmp_path_factory.mktemp("srv"), "oa", "--served-model-name", "tiny-agent")
    yield s
    s.kill()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny-agent"]


def test_chat_tokens_equal_generate_with_the_same_seed(client, server, tool_model):
    codec = ChatCodec.load(str(tool_model))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(
        model="tiny-agent", messages=msgs, max_tokens=12, temperature=1.0, seed=7, logprobs=True
    )
    (choice,) = r.choices
    body = {
        "input_ids": codec.encode_chat(msgs),
        "sampling_params": {
            "max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7,
            "stop_token_ids": codec.stop_token_ids,
        },
        "return_logprob": True,
    }  # fmt: skip
    g = generate(server.url, body)
    assert choice.message.content == codec.decode_action(g["output_ids"])
    lps = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
    # the same tokens; float32 logprobs of two requests batched differently by the engine differ by
    # a few ulps (seen: 1.2e-6 under load)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(lps, abs=1e-5)
    assert [t.token for t in choice.logprobs.content] == [codec.decode([t]) for t in g["output_ids"]]
    assert r.usage.prompt_tokens == len(body["input_ids"]) and r.usage.completion_tokens == len(lps)
    assert choice.finish_reason == ("stop" if g["output_ids"][-1] in codec.stop_token_ids else "length")


def test_streaming_gives_the_same_text(client):
    kw = {
        "model": "tiny-agent",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "seed": 3,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"


def test_n_samples_and_top_logprobs(client):
    r = client.chat.completions.create(
        model="tiny-agent", messages=ASK, n=3, max_tokens=6, seed=1, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        for t in c.logprobs.content:
            assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6


def test_tool_call_parsed_streamed_and_answered(client):
    r = client.chat.completions.create(
        model="tiny-agent", messages=ASK, tools=[CALC], temperature=0, max_tokens=40
    )
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and not (c.message.content or "").strip()
    (call,) = c.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
        "expression": "12 * 7"
    }
    # streamed: no raw <tool_call> text, the call arrives whole
    chunks = list(
        client.chat.completions.create(
            model="tiny-agent", messages=ASK, tools=[CALC], temperature=0, max_tokens=40, stream=True
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert "<tool_call>" not in text and [tc.function.name for tc in calls] == ["calculator"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool's answer goes back as a tool message; the model continues
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "84"},
    ]
    r2 = client.chat.completions.create(
        model="tiny-agent", messages=follow, tools=[CALC], max_tokens=4, seed=0
    )
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_messages_render_as_training_renders_them(codec):
    msgs = [
        {"role": "system", "content": "S"},
        *ASK,
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'}},
            {"id": "b", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "84"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    want = [
        {"role": "system", "content": "S"},
        *ASK,
        {"role": "assistant", "content": "Let me compute.\n" + CALL_TEXT + "\n"
            + format_tool_call("calculator", {"expression": "1+1"})},
        {"role": "user", "content": format_tool_responses(["84", "2"])},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    assert codec.encode_chat(render_messages(msgs), [CALC]) == codec.encode_chat(want, [CALC])


def test_completions_route(client, server, tool_model):
    codec = ChatCodec.load(str(tool_model))
    r = client.completions.create(
        model="tiny-agent", prompt="12 * 7 =", max_tokens=5, temperature=0, logprobs=1
    )
    (c,) = r.choices
    body = {"text": "12 * 7 =", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    g = generate(server.url, body)
    assert c.text == codec.decode_action(g["output_ids"]) and len(c.logprobs.token_logprobs) == len(
        g["output_ids"]
    )


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({"temperature": "hot"}, "temperature", "temperature: must be a"),
        ({"messages": []}, "messages", "messages: must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "needs a role"),
        ({"tool_choice": "required", "tools": [CALC]}, "tool_choice", "constrained decoding"),
        ({"top_p": 0}, None, "top_p"),
    ],
)
def test_bad_requests_get_openais_error_shape(client, kwargs, param, says):
    args = {"model": "tiny-agent", "messages": ASK, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    err = e.value.body
    assert e.value.status_code == 400 and says in err["message"], err
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_an_image_to_a_text_model_is_a_clear_error(client):
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    with pytest.raises(openai.BadRequestError, match="text-only model"):
        client.chat.completions.create(
            model="tiny-agent",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}],
            max_tokens=2,
        )


def _post(url: str, data: bytes, content_type: str = "application/json") -> tuple[int, dict | str]:
    import urllib.error

    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


NESTED = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/chat/completions", NESTED, "request body is nested too deeply"),
        ("/v1/completions", NESTED.replace(b'"messages"', b'"prompt"'), "request body is nested too deeply"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": 5}]},
         "messages[0].tool_calls: must be a list, got 5"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": ["x"], "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]},
         "messages[0].tool_calls[0].id: must be a string"),
        ("/v1/chat/completions", {"messages": [*ASK, {"role": "tool", "tool_call_id": {"id": 1}, "content": "4"}]},
         "messages[1].tool_call_id: must be a string"),
        ("/v1/completions", {"prompt": [True]}, "prompt: must be a non-empty string or a list of token ids"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt: token id 1000000000 outside the vocabulary"),
    ],
)  # fmt: skip
def test_malformed_openai_bodies_are_400s_naming_the_field(server, path, body, says):
    data = (
        body
        if isinstance(body, bytes)
        else json.dumps({"model": "tiny-agent", "max_tokens": 2, **body}).encode()
    )
    status, out = _post(server.url + path, data)
    assert status == 400 and isinstance(out, dict) and says in out["error"]["message"], (
        status,
        str(out)[:500],
    )
    assert out["error"]["type"] == "invalid_request_error"


def test_a_bogus_charset_is_read_as_utf8(server):
    data = json.dumps({"model": "tiny-agent", "messages": ASK, "max_tokens": 2}).encode()
    status, out = _post(server.url + "/v1/chat/completions", data, "application/json; charset=bogus")
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant", out


def test_fuzzed_openai_bodies_get_4xx_or_2xx(server):
    """Messages, tools and sampling fields of the wrong shapes: never a 500, the server stays up."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=8),
                     st.sampled_from(["user", "assistant", "tool", "system", "function", "calculator", "auto"]))  # fmt: skip
    value = st.recursive(leaf, lambda v: st.lists(v, max_size=3) | st.dictionaries(
        st.sampled_from(["role", "content", "tool_calls", "id", "function", "name", "arguments", "type",
                         "tool_call_id", "text", "image_url", "url"]), v, max_size=4), max_leaves=10)  # fmt: skip
    fields = ["messages", "tools", "tool_choice", "temperature", "top_p", "n", "stop", "logprobs", "top_logprobs",
              "seed", "stream", "prompt", "max_tokens", "response_format"]  # fmt: skip

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
           body=st.dictionaries(st.sampled_from(fields), value, max_size=5))  # fmt: skip
    def check(path, body):
        body = {**body, "model": "tiny-agent", "max_tokens": 2, "n": 1}
        status, out = _post(server.url + path, json.dumps(body, allow_nan=True).encode())
        assert status < 500, (path, body, status, str(out)[:400])

    check()
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
