"""Structured output and tool calling over the server (the openai SDK and raw HTTP), on Qwen3's own
template (calls as `<tool_call>` JSON) and on Llama 3.1's own template (tests/data), and the tool-call
parser by itself.

How the synthetic model's output is forced: its weights are random, so what it writes is whatever the
request's grammar leaves it. A tool call the model "decides" to make is a `grammar` (the server's
extension field) whose one sentence is the scripted reply (text, then a call); tool_choice "required" or a
named function is forced by the server's own grammar (server.tools.forcing_grammar), whose arguments the
random model fills under the tool's parameters schema (checked with jsonschema)."""

import json

import httpx
import pytest

import mlxinfer
from mlxinfer.server.tools import ToolCallParser, call_format

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from mlxinfer.synthetic import rewrite_gguf, write_synthetic_model  # noqa: E402
from tests.test_server import MODEL, SHAPE, Served  # noqa: E402

# Qwen3's own chat template (Qwen/Qwen3-0.6B's, as llama.cpp keeps it in models/templates, shipped in
# llama-cpp-python 0.3.36's source distribution): tools listed in the system turn, calls as <tool_call>
# JSON, tool results as <tool_response> in a user turn, <think> blocks.
with open("tests/data/Qwen-Qwen3-0.6B.jinja") as f:
    HERMES = f.read()
with open("tests/data/llama-cpp-chat-templates.json") as f:
    LLAMA31 = json.load(f)["templates"]["meta-llama/Llama-3.1-8B-Instruct"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def lark_literal(text: str) -> str:
    """A Lark grammar whose one sentence is `text`."""
    return "start: " + json.dumps(text)


@pytest.fixture(scope="module", params=["cpu", "mlx"])
def backend(request):
    return request.param


def _served(tmp_path_factory, backend, template):
    base = write_synthetic_model(tmp_path_factory.mktemp("tools") / "base.gguf", **{**SHAPE, "context_length": 4096})
    path = rewrite_gguf(base, tmp_path_factory.mktemp("tools") / MODEL, edits={"tokenizer.chat_template": template})
    return Served(mlxinfer.load(path, backend=backend, kv="paged"), max_batch=8, max_queue=64)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, backend):
    s = _served(tmp_path_factory, backend, HERMES)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, backend):
    s = _served(tmp_path_factory, backend, LLAMA31)
    yield s
    s.stop()


def test_the_template_tells_the_call_format():
    assert call_format(HERMES) == "hermes" and call_format(LLAMA31) == "llama3"
    assert call_format(None) is None and call_format("{{ messages }}") is None


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_the_parser_finds_calls_across_pieces_and_keeps_bad_ones_as_text(size):
    bad = '<tool_call>\n{"name": oops}\n</tool_call>'
    text = f"Let me look. <tool_call>\n{CALL}\n</tool_call> and <tool_c then{bad}<tool_call>{CALL}"
    p, content, calls = ToolCallParser("hermes"), "", []
    for i in range(0, len(text), size):
        c, found = p.feed(text[i:i + size])
        content, calls = content + c, calls + found
    c, found = p.finish()  # the last call has no closing tag: the turn ended in it
    content, calls = content + c, calls + found
    assert content == "Let me look.  and <tool_c then" + bad
    assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == \
        [("get_weather", {"city": "Paris", "days": 2})] * 2
    assert calls[0]["id"] != calls[1]["id"] and p.found == calls
    llama = ToolCallParser("llama3")
    assert llama.feed(' {"name": "get_time", "parameters": {"zone": "UTC"}}') == ("", [])
    _, (call,) = llama.finish()
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    prose = ToolCallParser("llama3")
    assert prose.feed("It is sunny.") == ("It is sunny.", []) and prose.finish() == ("", [])
    broken = ToolCallParser("llama3")
    assert broken.feed('{"name": ') == ("", []) and broken.finish() == ('{"name": ', [])
    # a Llama 3 reply that names its arguments "arguments" (as OpenAI does) keeps them
    openai_style = ToolCallParser("llama3")
    assert openai_style.feed('{"name": "get_time", "arguments": {"zone": "UTC"}}') == ("", [])
    _, (call,) = openai_style.finish()
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, content, calls, finish


def test_hermes_round_trip_with_the_openai_sdk(hermes):
    """The model writes text then a call (forced by a grammar): the text is content, the call a
    tool_call, finish_reason "tool_calls"; streamed, the text comes as content deltas before the call's
    delta. The call and the tool's result go back in the history, and the template renders both."""
    reply = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
    kw = dict(messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=120,
              extra_body={"grammar": lark_literal(reply)})
    r = hermes.client.chat.completions.create(model=MODEL, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    chunks, content, calls, finish = _stream(hermes.client, **kw)
    assert content == "Let me check.\n" and finish == ["tool_calls"]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert any(c.choices[0].delta.content for c in chunks[:first_call])  # text streamed before the call
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r2 = hermes.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                               max_tokens=20, extra_body={"grammar": lark_literal("It is 21.")})
    assert r2.choices[0].message.content == "It is 21." and r2.choices[0].finish_reason == "stop"
    engine = hermes.app.state.server.engine
    rendered = engine.tokenizer.decode(engine.encode_prompt(
        [{"role": m["role"], "content": m.get("content") or "",
          **({"tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
             if m.get("tool_calls") else {})} for m in history], template_kwargs={"tools": [WEATHER]}))
    assert r2.usage.prompt_tokens == len(engine.encode_prompt(
        [{"role": m["role"], "content": m.get("content") or "",
          **({"tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
             if m.get("tool_calls") else {})} for m in history], template_kwargs={"tools": [WEATHER]}))
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in rendered and CALL in rendered


def test_a_call_with_invalid_json_is_content_streamed_or_not(hermes):
    reply = 'Hmm <tool_call>\n{"name": get_weather}\n</tool_call>'
    kw = dict(messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80, extra_body={"grammar": lark_literal(reply)})
    r = hermes.client.chat.completions.create(model=MODEL, **kw)
    assert r.choices[0].message.content == reply and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    _, content, calls, finish = _stream(hermes.client, **kw)
    assert content == reply and calls == [] and finish == ["stop"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_required_or_named_forces_a_valid_call(hermes, llama, choice):
    for served in (hermes, llama):
        for stream in (False, True):
            kw = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=5,
                      max_tokens=120)
            if stream:
                _, content, calls, finish = _stream(served.client, **kw)
                fns = [c.function for c in calls]
            else:
                r = served.client.chat.completions.create(model=MODEL, **kw)
                content, finish = r.choices[0].message.content or "", [r.choices[0].finish_reason]
                fns = [c.function for c in r.choices[0].message.tool_calls]
            assert finish == ["tool_calls"] and content.strip() == "" and len(fns) == 1
            tool = {"get_weather": WEATHER, "get_time": TIME}[fns[0].name]
            if isinstance(choice, dict):
                assert fns[0].name == "get_time"
            jsonschema.validate(json.loads(fns[0].arguments), tool["function"]["parameters"])


def test_llama3_round_trip_with_the_openai_sdk(llama):
    """Llama 3.1's template: the tools go in the first user turn, the reply is one JSON object with
    "parameters"; the call goes back as an assistant message and the result as a tool message."""
    reply = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}'
    kw = dict(messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80, extra_body={"grammar": lark_literal(reply)})
    r = llama.client.chat.completions.create(model=MODEL, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 3}
    _, content, calls, finish = _stream(llama.client, **kw)
    assert content == "" and finish == ["tool_calls"] and calls[0].function.name == "get_weather"
    engine = llama.app.state.server.engine
    assert "get_weather" in engine.tokenizer.decode(engine.encode_prompt(ASK, template_kwargs={"tools": [WEATHER]}))
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "cold"}]
    r2 = llama.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                              max_tokens=20, extra_body={"grammar": lark_literal("It is cold.")})
    assert r2.choices[0].message.content == "It is cold." and r2.choices[0].finish_reason == "stop"
    # The call went back as an object: Llama 3.1's template writes `arguments | tojson` with no string
    # case (Qwen3's has one), so arguments kept as JSON text would be rendered quoted, a longer prompt.
    as_object = [{"role": m["role"], "content": m.get("content") or "",
                  **({"tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}]}
                     if m.get("tool_calls") else {})} for m in history]
    rendered = engine.tokenizer.decode(engine.encode_prompt(as_object, template_kwargs={"tools": [WEATHER]}))
    assert '"parameters": {"city": "Oslo", "days": 3}' in rendered
    assert r2.usage.prompt_tokens == len(engine.encode_prompt(as_object, template_kwargs={"tools": [WEATHER]}))
    prose = llama.client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                                 max_tokens=20, extra_body={"grammar": lark_literal("No call.")})
    assert prose.choices[0].message.content == "No call." and prose.choices[0].finish_reason == "stop"


def test_tool_choice_none_renders_no_tools_and_parses_nothing(hermes):
    engine = hermes.app.state.server.engine
    reply = f"<tool_call>\n{CALL}\n</tool_call>"
    r = hermes.client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                              temperature=0, max_tokens=120, extra_body={"grammar": lark_literal(reply)})
    assert r.choices[0].message.content == reply and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(engine.encode_prompt(ASK))


def test_structured_output_over_the_api(hermes):
    schema = WEATHER["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for i in range(3):
        r = hermes.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0.8,
                                                  seed=i, max_tokens=60)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = hermes.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=1.0,
                                              seed=3, max_tokens=60, n=3)  # choices share the prefill, not the grammar state
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    _, content, _, finish = _stream(hermes.client, messages=ASK, response_format={"type": "json_object"},
                                    temperature=0.8, seed=1, max_tokens=60)
    assert isinstance(json.loads(content), dict) and finish == ["stop"]
    r = hermes.client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0, seed=2,
                                         extra_body={"guided_regex": "[0-9]{4}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()


@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "bad json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "Input should be"),
    ({"grammar": "root ::= ("}, "grammar", "bad grammar"),
    ({"guided_regex": "[a-"}, "guided_regex", "bad regex"),
    ({"grammar": 'root ::= "a"', "guided_regex": "a"}, None, "one constraint per request"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "does not go with"),
    ({"tools": [WEATHER], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "not in chat_template"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", "Field"),
    ({"messages": [{"role": "user"}]}, "messages.0", "needs content"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0", "only a tool message"),
])
def test_bad_structured_and_tool_requests_are_400s(hermes, extra, param, fragment):
    r = httpx.post(hermes.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and (param is None or err["param"] == param), err


def test_tools_on_a_template_without_them_are_a_400(tmp_path_factory, backend):
    s = _served(tmp_path_factory, backend, "{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]},
                       timeout=10)
        assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]
    finally:
        s.stop()
