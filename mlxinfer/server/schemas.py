"""What the server reads and what it writes: the request bodies as pydantic models (strict types, so
that `"max_tokens": "ten"` is a 400 and not a coercion), and builders of the objects OpenAI's clients
parse: completions and chat completions, their stream chunks, usage, logprobs and the error object.

Completions and chat share the options and differ in their prompt and their shapes; a builder takes
`chat` where the two shapes differ.
"""

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Number = StrictInt | StrictFloat
MAX_CHOICES = 16  # n: each choice is a sequence of the batch (and counts against --max-batch)

# Every field a request may carry is a field of the models below; any other is a 400 naming it
# (errors.validation_error), never ignored. Fields we accept and that change nothing here, and why:
#   user, metadata      an end-user id and tags for the client's own records
#   store               OpenAI keeps the completion for its dashboards (only false: nothing is stored)
#   service_tier        OpenAI's capacity tiers ("auto" or "default": there is one tier)
#   parallel_tool_calls meaningless without `tools`, which are refused
# Fields clients send that we refuse by name (OpenAI's, not implemented here), with what to do instead:
REFUSED = {
    "response_format": "structured output is not implemented",
    "tools": "tool calling is not implemented", "tool_choice": "tool calling is not implemented",
    "functions": "function calling is not implemented", "function_call": "function calling is not implemented",
    "audio": "audio output is not implemented", "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented", "web_search_options": "web search is not implemented",
    "reasoning_effort": "reasoning effort is not implemented", "suffix": "insertion (suffix) is not implemented",
    "best_of": "best_of is not implemented (use n)", "echo": "echo is not implemented",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False


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


class CompletionRequest(Options):
    prompt: StrictStr | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # N: the chosen token and N alternatives


class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr


class Message(Strict):
    # developer: OpenAI's name for the system role of its newer models, rendered as system
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported (only text parts)")
        return content

    def for_template(self) -> dict:
        """The message as chat templates read it: a system role, the text parts joined by newlines
        (as vLLM joins them), and the name where one was given."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        m = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            m["name"] = self.name
        return m


class ChatRequest(Options):
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[StrictStr, object] | None = None  # vLLM's: more variables for the template


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
               chat: bool, fingerprint: str, reasoning: str = "", index: int = 0) -> dict:
    """The whole answer of a request that was not streamed; reasoning: a chat turn's `<think>` text;
    index: the choice's (n > 1)."""
    if chat:
        message = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "system_fingerprint": fingerprint, "choices": [choice], "usage": usage}


def chunk(rid: str, model_id: str, fingerprint: str, text: str, logprobs: dict | None, finish_reason: str | None,
          chat: bool, first: bool = False, reasoning: str = "", index: int = 0) -> dict:
    """One event of a stream: a token's text, or the finish reason with the text held back for a stop
    string. A chat stream's first delta carries the role; its finishing delta is empty when no text is
    left; reasoning (`<think>` text) goes in the delta's `reasoning_content`, content alone in `content`."""
    if chat:
        delta = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or first or (finish_reason is None and not reasoning):
            delta["content"] = text
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
