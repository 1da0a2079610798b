"""Structured output: a grammar that a sequence's tokens must follow, enforced by a token mask per step.

A request's constraint (`Constraint`) is one of: a JSON schema (OpenAI's `response_format` json_schema),
any JSON object (json_object), a Lark or GBNF grammar, or a regular expression. It is compiled once, when
the request is made, by llguidance (the grammar engine; why it: compiling a schema takes milliseconds
and a mask tens of microseconds, where outlines-core took seconds to compile), against an llguidance
tokenizer built from the model's own vocabulary (`GrammarTokenizer`: each token's bytes, control
tokens marked as special so that no grammar text can spell them, and every end-of-generation token as
an end token).

Each sequence then owns a `Matcher`: the compiled grammar's state after the tokens it generated. Before
each of its tokens is sampled, the matcher writes the set of tokens the grammar allows next as a bitmask
(one bit per token of the model's output width, 32 to a word), and the sampler sets the logits of every
other token to -inf (`mlxinfer.sampling`, step 0; on MLX the packed mask goes to the device and is
unpacked there). An end-of-generation token is allowed only where the grammar accepts what came before;
where the grammar can take nothing more, the sequence finishes ("stop") without sampling one. A mask is
a function of the sequence's own tokens only, so a masked sequence's output does not depend on the other
sequences of its batch.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np

from .errors import RequestError
from .tokenizer import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED, GGUFTokenizer,
                        byte_level_alphabet)

KINDS = ("json_schema", "json_object", "grammar", "regex")
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object, as OpenAI's JSON mode
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): with whitespace free, a model
# can fill max_tokens with newlines inside an object that never closes. A schema's "x-guidance" overrides it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 200_000  # a grammar or schema is compiled on the request's thread: bounded in size


class GrammarError(RequestError):
    """A request's constraint is bad (or cannot be used here): what, in one line."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an optional dependency: the `structured` extra
        raise GrammarError("structured output needs llguidance: pip install 'mlxinfer[structured]'") from None
    return llguidance


@dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled grammar: `kind` (one of KINDS), the `source` the user gave (the schema as a dict, or
    the grammar's or regex's text), and llguidance's matcher in its initial state, copied for each
    sequence (`matcher()`)."""

    kind: str
    source: object
    _initial: object = field(repr=False)
    width: int = 0  # the logits' width the masks cover

    def matcher(self) -> "Matcher":
        return Matcher(self._initial.deep_copy(), self.width)


class Matcher:
    """One sequence's grammar state: `mask_into(row)` writes the allowed next tokens, `advance(token)`
    takes the token it generated."""

    def __init__(self, m, width: int):
        self._m = m
        self.width = width

    def mask_into(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row`, an int32 bitmask of ceil(width / 32) words."""
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.int32)
        n = min(row.size, words.size)
        row[:n], row[n:] = words[:n], 0

    def advance(self, token: int) -> str | None:
        """Take a generated token; the error, where the grammar does not allow it (None: allowed)."""
        if self._m.consume_token(int(token)):
            return None
        return self._m.get_error() or f"token {token} is not allowed by the grammar"

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more tokens (only an end of generation)."""
        return self._m.is_stopped() and not self._m.is_error()


def mask_words(width: int) -> int:
    return (width + 31) // 32


def unpack_numpy(words: np.ndarray, width: int) -> np.ndarray:
    """bool [rows, width] from int32 bitmasks [rows, words] (bit i of word w: token 32 w + i)."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :width].astype(bool)


def unpack_mlx(words, width: int):
    """The same unpacking as an MLX graph (on the device): bool [rows, width]."""
    import mlx.core as mx

    idx = mx.arange(width, dtype=mx.int32)
    picked = mx.take(words, idx // 32, axis=-1)
    return mx.bitwise_and(mx.right_shift(picked, idx % 32), 1).astype(mx.bool_)


class _Identity:
    """A key that is its object's identity (a tokenizer is an unhashable dataclass)."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return self.obj is other.obj


def token_bytes(tokenizer: GGUFTokenizer, i: int) -> bytes:
    """Token i's bytes as llguidance reads them: text tokens their bytes (user-defined ones too, such as
    Qwen3's "<tool_call>": our tokenizer matches and decodes them as text), control and unknown tokens
    0xFF then their name, llguidance's mark of a special token, which no grammar text matches."""
    text, kind = tokenizer.tokens[i], int(tokenizer.token_types[i])
    if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
        return b"\xff" + text.encode("utf-8")
    if kind == TOKEN_USER_DEFINED:
        return text.encode("utf-8")
    if tokenizer.spm is not None:
        if kind == TOKEN_UNUSED:
            return b""
        return tokenizer.spm.piece(i, special=False) if kind != TOKEN_BYTE else bytes([int(text[3:5], 16)])
    return bytes(_BYTE_OF[c] for c in text) if all(c in _BYTE_OF for c in text) else text.encode("utf-8")


_BYTE_OF = {c: b for b, c in enumerate(byte_level_alphabet())}


class _Wrapper:
    """What llguidance's TokenizerWrapper reads from a tokenizer: tokens as bytes, and encoding."""

    def __init__(self, tokenizer: GGUFTokenizer, width: int):
        self._tok = tokenizer
        self.tokens = [token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (width - len(self.tokens))  # output rows past the vocabulary: never allowed
        self.eos_token_id = min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"))


@functools.lru_cache(maxsize=4)
def _llg_tokenizer(key: _Identity, width: int):
    llg = _llguidance()
    tokenizer = key.obj
    return llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper(tokenizer, width)), n_vocab=width,
                           eos_token=sorted(tokenizer.eog_ids))


def grammar_tokenizer(tokenizer: GGUFTokenizer, width: int):
    """llguidance's tokenizer for `tokenizer` and logits `width` wide (made once: ~1 s for 150k tokens)."""
    if not tokenizer.eog_ids:
        raise GrammarError("structured output needs an end-of-generation token, which this model's vocabulary lacks")
    return _llg_tokenizer(_Identity(tokenizer), max(width, tokenizer.vocab_size))


def compile_constraint(tokenizer: GGUFTokenizer, width: int, kind: str, source) -> Constraint:
    """A Constraint of `kind` from `source` (a JSON schema as a dict or JSON text; a Lark or GBNF
    grammar's text; a regex's text; None for json_object). Bad input is a RequestError naming it."""
    llg = _llguidance()
    if kind not in KINDS:
        raise GrammarError(f"constraint kind {kind!r} (choose from {', '.join(KINDS)})")
    if kind == "json_object":
        source = ANY_OBJECT
    if kind in ("json_schema", "json_object"):
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(source, dict):
            raise GrammarError(f"a JSON schema is an object, got {type(source).__name__}")
        text = json.dumps(source)
    elif not isinstance(source, str) or not source.strip():
        raise GrammarError(f"a {kind} is non-empty text")
    else:
        text = source
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} has {len(text)} characters (limit {MAX_GRAMMAR_CHARS})")
    try:
        if kind in ("json_schema", "json_object"):
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(text)
        else:  # Lark, or GBNF (llama.cpp's), which llguidance converts to Lark
            grammar = llg.grammar_from("grammar", text)
    except ValueError as e:
        raise GrammarError(f"bad {kind}: {str(e).splitlines()[0]}") from None
    tok = grammar_tokenizer(tokenizer, width)
    error = llg.LLMatcher.validate_grammar(grammar, tok)
    if error:
        raise GrammarError(f"bad {kind}: {' '.join(error.split())[:300]}")
    initial = llg.LLMatcher(tok, grammar, log_level=0)
    if initial.is_error():
        raise GrammarError(f"bad {kind}: {' '.join(initial.get_error().split())[:300]}")
    return Constraint(kind, source, initial, tok.vocab_size)


def constraint_of(tokenizer: GGUFTokenizer, width: int, response_format=None, grammar: str | None = None,
                  regex: str | None = None) -> Constraint | None:
    """The one constraint of a request's options, or None: `response_format` as OpenAI's
    ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}),
    `grammar` (Lark or GBNF text) or `regex`; more than one is a RequestError."""
    given = [name for name, v in (("response_format", response_format), ("grammar", grammar), ("regex", regex))
             if v is not None and not (name == "response_format" and isinstance(v, dict) and v.get("type") == "text")]
    if len(given) > 1:
        raise GrammarError(f"one constraint per request: {given[0]} or {given[1]}, not both")
    if grammar is not None:
        return compile_constraint(tokenizer, width, "grammar", grammar)
    if regex is not None:
        return compile_constraint(tokenizer, width, "regex", regex)
    if response_format is None:
        return None
    if not isinstance(response_format, dict) \
            or response_format.get("type") not in ("text", "json_object", "json_schema"):
        raise GrammarError("response_format is {'type': 'text' | 'json_object' | 'json_schema', ...}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return compile_constraint(tokenizer, width, "json_object", None)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise GrammarError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}")
    return compile_constraint(tokenizer, width, "json_schema", spec["schema"])
