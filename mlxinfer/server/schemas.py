"""What the server reads and what it writes: the request bodies as pydantic models (strict types, so
that `"max_tokens": "ten"` is a 400 and not a coercion), and builders of the objects OpenAI's clients
parse: completions and chat completions, their stream chunks, usage, logprobs and the error object.

Completions and chat share the options and differ in their prompt and their shapes; a builder takes
`chat` where the two shapes differ.
"""

import time
import uuid
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)

from .tools import template_call

Number = StrictInt | StrictFloat
MAX_CHOICES = 16  # n: each choice is a sequence of the batch (and counts against --max-batch)

# Every field a request may carry is a field of the models below; any other is a 400 naming it
# (errors.validation_error), never ignored. Fields we accept and that change nothing here, and why:
#   user, metadata      an end-user id and tags for the client's own records
#   store               OpenAI keeps the completion for its dashboards (only false: nothing is stored)
#   service_tier        OpenAI's capacity tiers ("auto" or "default": there is one tier)
#   parallel_tool_calls every call the model writes is returned (a model writes one or several)
# Fields clients send that we refuse by name (OpenAI's, not implemented here), with what to do instead:
REFUSED = {
    "functions": "the deprecated functions are not implemented (use tools)",
    "function_call": "the deprecated function_call is not implemented (use tool_choice)",
    "audio": "audio output is not implemented", "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented", "web_search_options": "web search is not implemented",
    "reasoning_effort": "reasoning effort is not implemented", "suffix": "insertion (suffix) is not implemented",
    "best_of": "best_of is not implemented (use n)", "echo": "echo is not implemented",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False


class JsonSchemaFormat(Strict):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[StrictStr, object] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def for_engine(self) -> dict:
        """As `Engine.sampling_params(response_format=)` takes it (OpenAI's shape)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class Options(Strict):
    """The options both endpoints take; mlxinfer.sampling says what each sampling option does."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)  # not OpenAI's; vLLM's and llama-server's (0: off)
    min_p: Number = Field(default=0.0, ge=0, le=1)
    repetition_penalty: Number = Field(default=1.0, gt=0)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[StrictStr, Number] | None = None  # token id (as JSON keys are text) -> bias in [-100, 100]
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)  # choices of one prompt, prefilled once
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: StrictBool | None = None
    # structured output (mlxinfer.grammar): OpenAI's response_format, or (not OpenAI's) a Lark or GBNF
    # grammar (llama-server's `grammar`) or a regular expression (vLLM's `guided_regex`); one at most
    response_format: ResponseFormat | None = None
    grammar: StrictStr | None = None
    guided_regex: StrictStr | None = None


class CompletionRequest(Options):
    prompt: StrictStr | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # N: the chosen token and N alternatives


class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Function(Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[StrictStr, object] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class Message(Strict):
    # developer: OpenAI's name for the system role of its newer models, rendered as system; tool: a
    # tool's result (tool_call_id: the call it answers); an assistant message may carry tool_calls
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported (only text parts)")
        return content

    @model_validator(mode="after")
    def content_or_calls(self):
        """Content may be absent only from an assistant message that calls tools (OpenAI's rule); only an
        assistant message calls tools, only a tool message answers one."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has tool_call_id")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: a system role, the text parts joined by newlines
        (as vLLM joins them), and the name where one was given."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        m = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [template_call(c.id, c.function.name, c.function.arguments) for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class ChatRequest(Options):
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[StrictStr, object] | None = None  # vLLM's: more variables for the template
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


def error_object(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs_object(token_texts: list[str], token_logprobs: list[float], offsets: list[int], chat: bool,
                    top: list | None = None) -> dict:
    """The logprobs of some generated tokens; offsets: where each token's text starts in the
    completion's text (completions' `text_offset`; chat has no such field); top: per token, the
    [(text, logprob)] of the most likely tokens, where they were asked for."""
    if chat:
        return {"content": [{"token": t, "logprob": p, "bytes": list(t.encode("utf-8")),
                             "top_logprobs": [{"token": a, "logprob": q, "bytes": list(a.encode("utf-8"))}
                                              for a, q in (top[i] if top else [])]}
                            for i, (t, p) in enumerate(zip(token_texts, token_logprobs))]}
    # completions: one {text: logprob} per token, likeliest first (two tokens with one text: the likelier)
    tops = None if top is None else [dict(sorted(dict(reversed(alts)).items(), key=lambda kv: -kv[1])) for alts in top]
    return {"tokens": token_texts, "token_logprobs": list(token_logprobs), "top_logprobs": tops,
            "text_offset": list(offsets)}


def completion(rid: str, model_id: str, text: str, logprobs: dict | None, finish_reason: str, usage: dict,
               chat: bool, fingerprint: str, reasoning: str = "", index: int = 0,
               tool_calls: list | None = None) -> dict:
    """The whole answer of a request that was not streamed; reasoning: a chat turn's `<think>` text;
    index: the choice's (n > 1); tool_calls: the calls parsed out of the text (server.tools)."""
    if chat:
        message = {"role": "assistant", "content": text or (None if tool_calls else text)}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "system_fingerprint": fingerprint, "choices": [choice], "usage": usage}


def chunk(rid: str, model_id: str, fingerprint: str, text: str, logprobs: dict | None, finish_reason: str | None,
          chat: bool, first: bool = False, reasoning: str = "", index: int = 0, tool_calls: list | None = None,
          calls_before: int = 0) -> dict:
    """One event of a stream: a token's text, or the finish reason with the text held back for a stop
    string. A chat stream's first delta carries the role; its finishing delta is empty when no text is
    left; reasoning (`<think>` text) goes in the delta's `reasoning_content`, content alone in `content`;
    tool_calls: calls completed with this text, each whole in one delta (numbered from calls_before)."""
    if chat:
        delta = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or first or (finish_reason is None and not reasoning and not tool_calls):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": calls_before + k, **c} for k, c in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_id,
                "system_fingerprint": fingerprint, "choices": [choice]}
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
            "system_fingerprint": fingerprint, "choices": [choice]}


def usage_chunk(rid: str, model_id: str, fingerprint: str, usage: dict, chat: bool) -> dict:
    """The last event of a stream asked for `stream_options.include_usage`: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model_id, "system_fingerprint": fingerprint, "choices": [],
            "usage": usage}


def model_object(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlxinfer"}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model_id, created)]}
