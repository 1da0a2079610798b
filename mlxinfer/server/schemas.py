"""What the server reads and what it writes: the request bodies as pydantic models (strict types, so
that `"max_tokens": "ten"` is a 400 and not a coercion), and builders of the objects OpenAI's clients
parse: completions and chat completions, their stream chunks, usage, logprobs and the error object.

Completions and chat share the options and differ in their prompt and their shapes; a builder takes
`chat` where the two shapes differ.
"""

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


class Options(BaseModel):
    """The options both endpoints take; unknown fields are ignored, as OpenAI's clients send some."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: dict | None = None


class CompletionRequest(Options):
    prompt: StrictStr | list[StrictInt]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class ChatRequest(Options):
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)


def error_object(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs_object(token_texts: list[str], token_logprobs: list[float], offsets: list[int], chat: bool) -> dict:
    """The logprobs of some generated tokens; offsets: where each token's text starts in the
    completion's text (completions' `text_offset`; chat has no such field)."""
    if chat:
        return {"content": [{"token": t, "logprob": p, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                            for t, p in zip(token_texts, token_logprobs)]}
    return {"tokens": token_texts, "token_logprobs": list(token_logprobs), "top_logprobs": None,
            "text_offset": list(offsets)}


def completion(rid: str, model_id: str, text: str, logprobs: dict | None, finish_reason: str, usage: dict,
               chat: bool) -> dict:
    """The whole answer of a request that was not streamed."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [choice], "usage": usage}


def chunk(rid: str, model_id: str, text: str, logprobs: dict | None, finish_reason: str | None, chat: bool,
          first: bool = False) -> dict:
    """One event of a stream: a token's text, or the finish reason with the text held back for a stop
    string. A chat stream's first delta carries the role; its finishing delta is empty when no text is
    left."""
    if chat:
        delta = ({"role": "assistant", "content": text} if first else
                 ({"content": text} if finish_reason is None or text else {}))
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_id,
                "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
            "choices": [choice]}


def usage_chunk(rid: str, model_id: str, usage: dict, chat: bool) -> dict:
    """The last event of a stream asked for `stream_options.include_usage`: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [], "usage": usage}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "mlxinfer"}]}
