"""Chat templates: render `tokenizer.chat_template` (a Jinja2 template, as in HF tokenizers) with jinja2.

A model file is untrusted input, and so is its template. It is rendered in jinja2's immutable sandbox
(no attribute tricks), with the globals HF templates expect (`raise_exception`, `strftime_now`) and HF's
whitespace settings (trim_blocks, lstrip_blocks), and with bounds on what jinja2's sandbox leaves open:

- sizes: `*`, `+` and `**` refuse results past MAX_ITEMS characters or items (checked before the
  result is built), `range` is capped too, and the rendered text may not pass MAX_OUTPUT characters;
- work: a line counter on the template's own code stops loops (of any kind, output or not) after
  MAX_STEPS steps, and rendering stops after MAX_SECONDS;
- recursion: a self-recursive macro ends as a one-line error, not a traceback.

Every violation is a RequestError naming the problem, raised within about a second.
"""

from __future__ import annotations

import datetime
import functools
import sys
import time

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import RequestError

MAX_ITEMS = 1_000_000  # characters of a string / items of a sequence a template may build
MAX_OUTPUT = 1_000_000  # characters of rendered text
MAX_STEPS = 2_000_000  # lines of template code executed
MAX_SECONDS = 2.0


def _raise(message):
    raise TemplateError(message)


def _size(x) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                size = _size(seq)
                if size is not None and isinstance(n, int) and size * n > MAX_ITEMS:
                    raise SecurityError(f"the template builds a value of {size * n} items (limit {MAX_ITEMS})")
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > MAX_ITEMS:
                raise SecurityError(f"the template builds a value of {a + b} items (limit {MAX_ITEMS})")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError(f"the template raises to the power {right} (limit 64)")
        return super().call_binop(context, operator, left, right)


def _bounded_range(*args):
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise SecurityError(f"the template asks for a range of {len(r)} items (limit {MAX_ITEMS})")
    return r


class _Budget:
    """A trace function counting executed lines of template code (jinja2 compiles templates to Python
    functions whose file name is "<template>"), and the clock."""

    def __init__(self):
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename != "<template>":
            return None  # no per-line tracing outside the template (jinja2's runtime, filters)
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS or (self.steps % 4096 == 0 and time.monotonic() > self.deadline):
                raise SecurityError(f"the template ran past its work limit ({MAX_STEPS} steps or {MAX_SECONDS} s)")
        return self


SYSTEM_PROBE, USER_PROBE = "<<mlxinfer system probe>>", "<<mlxinfer user probe>>"


def render_chat(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, source: str = "chat template", **extra) -> str:
    """The template rendered for `messages`. Where the template has no system role (Gemma's raises on
    one, Phi-3 mini's drops it), each system message is joined to the next user message, system text
    first and a newline between, as llama.cpp's chat templates do (minja's system-role polyfill):
    nothing a request says is dropped."""
    if any(m.get("role") == "system" for m in messages) and not supports_system_role(template, bos_token, eos_token):
        messages = merge_system_messages(messages)
    return _render(template, messages, bos_token=bos_token, eos_token=eos_token,
                   add_generation_prompt=add_generation_prompt, source=source, **extra)


@functools.lru_cache(maxsize=16)
def supports_system_role(template: str, bos_token: str = "", eos_token: str = "") -> bool:
    """Whether the template renders a system message's text (probed with marker texts, as minja does;
    once per template)."""
    probe = [{"role": "system", "content": SYSTEM_PROBE}, {"role": "user", "content": USER_PROBE}]
    try:
        return SYSTEM_PROBE in _render(template, probe, bos_token=bos_token, eos_token=eos_token,
                                       add_generation_prompt=False, source="chat template")
    except RequestError:
        return False


def merge_system_messages(messages: list[dict]) -> list[dict]:
    """System messages joined to the next user message ("system\nuser"); one with no user message after
    it becomes a user message of its own."""
    out, pending = [], []
    for m in messages:
        if m.get("role") == "system":
            pending.append(m.get("content", ""))
        elif m.get("role") == "user" and pending:
            out.append({**m, "content": "\n".join([*pending, m.get("content", "")])})
            pending = []
        else:
            out.append(m)
    return out + ([{"role": "user", "content": "\n".join(pending)}] if pending else [])


def _render(template: str, messages: list[dict], *, bos_token: str, eos_token: str, add_generation_prompt: bool,
            source: str, **extra) -> str:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["range"] = _bounded_range
    budget = _Budget()
    previous = sys.gettrace()
    try:
        compiled = env.from_string(template)
        sys.settrace(budget)
        pieces, length = [], 0
        for piece in compiled.generate(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                       add_generation_prompt=add_generation_prompt, **extra):
            length += len(piece)
            if length > MAX_OUTPUT:
                raise SecurityError(f"the rendered text passes {MAX_OUTPUT} characters")
            pieces.append(piece)
        return "".join(pieces)
    except (TemplateError, SecurityError) as e:
        raise RequestError(f"{source} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    except RecursionError:
        raise RequestError(f"{source} failed: recursion too deep (a macro that calls itself?)") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as e:
        raise RequestError(f"{source} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    except MemoryError:
        raise RequestError(f"{source} failed: out of memory") from None
    finally:
        sys.settrace(previous)
