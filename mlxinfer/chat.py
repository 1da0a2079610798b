"""Chat templates: render `tokenizer.chat_template` (a Jinja2 template, as in HF tokenizers) with jinja2.

Rendered in a sandbox, with the globals HF templates expect (`raise_exception`, `strftime_now`) and
HF's whitespace settings (trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import RequestError


def _raise(message):
    raise TemplateError(message)


def render_chat(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, **extra) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except TemplateError as e:
        raise RequestError(f"chat template failed: {e}") from None
