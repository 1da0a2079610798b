"""Tool calling: a request's `tools` rendered through the model's chat template, and the calls the model
writes parsed out of its text into OpenAI's `tool_calls`, whole or as stream deltas.

The chat templates of tool-calling models take `tools` (HF's convention: a list of OpenAI's tool
objects) and say in the prompt how a call is written. Two ways are parsed, told apart by the template:

- "hermes" (Qwen2.5, Qwen3, Hermes; the template mentions `<tool_call>`): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text may come before it;
- "llama3" (Llama 3.1-3.3; the template mentions `<|python_tag|>` or "parameters"): the whole reply is
  one JSON object `{"name": ..., "parameters": {...}}` (`<|python_tag|>`, a control token, is not in
  the text).

Text outside the calls is content, streamed as it comes (text that could start `<tool_call>` is held
back until it cannot). A call whose JSON does not parse, or has no name, is returned as the text the
model wrote, as content: nothing is lost. `tool_choice` "required" or a named function is enforced by
a grammar (`forcing_grammar`): the reply is one call of one of the (named) tools, its arguments
following the tool's parameters schema.
"""

from __future__ import annotations

import json
import uuid

from ..grammar import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("hermes", "llama3")


def call_format(template: str | None) -> str | None:
    """How the model behind `template` writes a call; None where the template does not render tools."""
    if not template or "tools" not in template:
        return None
    if OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or "parameters" in template:
        return "llama3"
    return None


def template_call(call_id: str, name: str, arguments: str) -> dict:
    """A call of an assistant message as chat templates read it: arguments as an object (HF's
    convention; templates write them with `tojson`), or as the text where it is not JSON."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def call_object(name: str, arguments) -> dict:
    """A call as OpenAI returns it: arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def parse_call(text: str, fmt: str) -> dict | None:
    """The call `text` (one call's JSON) writes, or None where it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("parameters" if fmt == "llama3" and "parameters" in obj else "arguments", {})
    if not isinstance(args, dict):
        return None
    return call_object(obj["name"], args)


class ToolCallParser:
    """feed(text) -> (content, calls) deltas; finish() -> the same for what was held back. `calls`
    holds every call found so far (`found`)."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"tool call format {fmt!r} (choose from {', '.join(FORMATS)})")
        self.fmt = fmt
        self.held = ""  # text that may start a call (hermes), or the whole reply so far (llama3)
        self.inside = False  # hermes: within <tool_call> ... </tool_call>
        self.started = False  # llama3: the reply's first non-space character has been seen
        self.json_reply = False  # llama3: ... and it opened a JSON object
        self.found: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.fmt == "llama3":
            return self._feed_llama3(text)
        content, calls = [], []
        pending = self.held + text
        self.held = ""
        while pending:
            if self.inside:
                at = pending.find(CLOSE)
                if at < 0:
                    self.held = pending
                    break
                body, pending = pending[:at], pending[at + len(CLOSE):]
                self.inside = False
                call = parse_call(body, self.fmt)
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                continue
            at = pending.find(OPEN)
            if at >= 0:
                content.append(pending[:at])
                pending, self.inside = pending[at + len(OPEN):], True
                continue
            keep = max((k for k in range(1, len(OPEN)) if pending.endswith(OPEN[:k])), default=0)
            content.append(pending[:len(pending) - keep])
            self.held = pending[len(pending) - keep:]
            break
        self.found += calls
        return "".join(content), calls

    def _feed_llama3(self, text: str) -> tuple[str, list[dict]]:
        if not self.started:
            self.held += text
            stripped = self.held.lstrip()
            if not stripped:
                return "", []
            self.started, self.json_reply = True, stripped.startswith("{")
            text, self.held = (self.held, "") if not self.json_reply else ("", self.held)
        if self.json_reply:
            self.held += text
            return "", []
        return text, []

    def finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        if self.fmt == "llama3":
            if not self.json_reply:
                return held, []
            call = parse_call(held, self.fmt)
            if call is None:
                return held, []
            self.found.append(call)
            return "", [call]
        if not self.inside:
            return held, []
        self.inside = False
        call = parse_call(held, self.fmt)  # a call the turn ended in without its closing tag
        if call is None:
            return OPEN + held, []
        self.found.append(call)
        return "", [call]


def forcing_grammar(fmt: str, tools: list[dict], name: str | None) -> str:
    """A Lark grammar (llguidance's, with %json) whose only sentences are one call of one of `tools`
    (of the one called `name`, where given), written as `fmt` writes it."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    key = "parameters" if fmt == "llama3" else "arguments"
    schema = {"x-guidance": JSON_LAYOUT, "anyOf": [
        {"type": "object", "properties": {"name": {"const": f["name"]},
                                          key: f.get("parameters") or {"type": "object"}},
         "required": ["name", key], "additionalProperties": False} for f in chosen]}
    body = "%json " + json.dumps(schema)
    return f"start: {body}" if fmt == "llama3" else f'start: "{OPEN}\\n" {body} "\\n{CLOSE}"'
