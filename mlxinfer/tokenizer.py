"""Tokenizer from GGUF metadata: byte-level BPE on HF `tokenizers`, SentencePiece as llama.cpp runs it.

GGUF stores a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`) as token strings, merges and
token types, plus a pre-tokenizer name (`tokenizer.ggml.pre`). The BPE itself is `tokenizers`' Rust
implementation; what is ours is the mapping from llama.cpp's pre-tokenizer names to the regex splits
llama.cpp applies (a sequence of "isolated" splits, each one refining the pieces of the one before),
and the mapping of token types to added tokens:

- CONTROL tokens (type 3) are special: matched in text only with `parse_special=True`, and dropped
  from decoded text with `skip_special=True`;
- USER_DEFINED tokens (type 4) are always matched in text and always decoded, as llama.cpp does.

A SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Phi-3, Gemma) is tokens,
scores and token types; `SentencePiece` below encodes it as llama.cpp's `llm_tokenizer_spm` does, a
transcription of its loop (~40 lines, 17 ms for 10,000 characters; `tokenizers` BPE: 5 ms). Why not
`tokenizers`: its Unigram model is a Viterbi search for the best segmentation, not llama.cpp's greedy
merge. Its BPE model, with merges ranked by the merged token's score, gave llama.cpp's ids on the 46
test texts and on 3,000 random strings of Llama 2's vocabulary, but it cannot say two
things llama.cpp does: a character that is no token merging into one that is (`tokenizers` spells it in
bytes first), and equal scores (Llama 2's sixteen runs of U+2581 all score -1e9) decided by position,
where BPE has one fixed rank per pair. The split at special tokens, Phi-3's whitespace strip after them
(C's isspace, not Unicode's) and the decoding are llama.cpp's too, and short.
"""

from __future__ import annotations

import codecs
import heapq
import os
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .errors import GGUFError, RequestError, UnsupportedError
from .gguf_file import GGUFFile, typed_value

# llama.cpp's token types (llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space
# End-of-generation and fill-in-the-middle names that llama.cpp's vocabulary loader turns into control
# tokens when a file types them otherwise (a user-defined </s> in Phi-3's vocabulary): each checked with
# llama-cpp-python 0.3.36 (a user-defined token of that name is not matched in text without parse_special).
CONTROL_LOOKING = frozenset([
    "</s>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", "<|fim_prefix|>", "<fim-prefix>", "<|fim_middle|>", "<fim_suffix>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|return|>", "<|call|>", "<|calls|>",
])

_CONTRACTIONS_CI = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEEPSEEK_LLM = [  # written with escapes: an editor's Unicode normalisation would change the ranges
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
]

# tokenizer.ggml.pre -> (regex splits applied in order, ignore_merges) as llama.cpp's llama-vocab.cpp.
_STARCODER = ([r"\p{N}", _GPT2], False)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], False),
    "gpt-2": ([_GPT2], False),
    "phi-2": ([_GPT2], False),
    "mpt": ([_GPT2], False),
    "olmo": ([_GPT2], False),
    "llama3": ([_LLAMA3], True),
    "llama-v3": ([_LLAMA3], True),
    "llama-bpe": ([_LLAMA3], True),
    "falcon3": ([_LLAMA3], True),
    "dbrx": ([_LLAMA3], False),
    "smaug-bpe": ([_LLAMA3], False),
    "qwen2": ([_QWEN2], False),
    "deepseek-r1-qwen": ([_QWEN2], False),
    "stablelm2": ([_QWEN2], False),
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "starcoder": _STARCODER,
    "smollm": _STARCODER,
    "refact": _STARCODER,
    "command-r": _STARCODER,
    "codeshell": _STARCODER,
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"], False),
}


def byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode table, in byte order: the 256 single-byte tokens of byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def token_ids(values) -> list[int]:
    """`values` (a list, tuple or other iterable of token ids, or a 1-D integer array) as a list of
    ints; anything but integers (1.9, True, "5") is a RequestError rather than silently truncated or
    coerced, and so is a 2-D array (a batch is `generate_batch`'s, not one prompt)."""
    not_ids = RequestError(f"token ids must be a list of integers, got {type(values).__name__}")
    if isinstance(values, (str, bytes, dict)):
        raise not_ids
    if not isinstance(values, (list, tuple)) and hasattr(values, "__array__"):
        values = np.asarray(values)  # numpy and MLX arrays
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise RequestError(f"token ids must be integers in one dimension, got an array of {values.dtype} "
                               f"with shape {values.shape}")
        return values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise not_ids from None
    bad = next((v for v in values if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))), None)
    if bad is not None:
        raise RequestError(f"token ids must be integers, got {repr(bad)[:40]}")
    return [int(i) for i in values]


class SentencePiece:
    """llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm` and the SPM branches of llama-vocab.cpp).

    Encoding: the text is split at special tokens (user-defined ones always, control and unknown ones
    when the caller asks), each piece of plain text gets a leading space when it starts the text or
    follows a special token (`add_space_prefix`), spaces become U+2581, and then, starting from single
    characters, the adjacent pair whose concatenation is the best-scoring token is merged (ties: the
    leftmost) until no pair forms a token. A character left over that is no token becomes its UTF-8
    bytes as <0xNN> tokens (byte fallback).
    Decoding is llama.cpp's `token_to_piece`: U+2581 back to a space in normal tokens, byte tokens as
    their byte, user-defined tokens verbatim, control and unknown tokens only when not skipped."""

    def __init__(self, tokens: list[str], scores: np.ndarray, types: np.ndarray, vocab: dict[str, int],
                 add_space_prefix: bool, rstrip: frozenset[int] = frozenset()):
        self.tokens, self.vocab, self.scores = tokens, vocab, scores.tolist()
        self.add_space_prefix = add_space_prefix
        self.rstrip = rstrip  # special tokens that eat the whitespace after them (llama.cpp's RSTRIP)
        self.bytes = [vocab.get(f"<0x{b:02X}>", vocab.get(chr(b)) if b < 128 else None) for b in range(256)]
        special = np.nonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN) | (types == TOKEN_USER_DEFINED))[0]
        by_length = sorted(special.tolist(), key=lambda t: -len(tokens[t]))

        def alternation(ids):  # longest first, so the regex takes the longest token at each place
            ids = [t for t in ids if tokens[t]]
            return re.compile("|".join(re.escape(tokens[t]) for t in ids)) if ids else None

        self.special = alternation(by_length)
        self.user_defined = alternation([t for t in by_length if types[t] == TOKEN_USER_DEFINED])
        self.pieces = [self._piece(tokens[t], int(types[t])) for t in range(len(tokens))]

    @staticmethod
    def _piece(text: str, kind: int) -> bytes | None:
        """A token's bytes in decoded text; None for a control or unknown token (shown only when asked)."""
        if kind == TOKEN_NORMAL:
            return text.replace(SPACE, " ").encode("utf-8")
        if kind == TOKEN_BYTE:
            return bytes([int(text[3:5], 16)])
        if kind == TOKEN_USER_DEFINED:
            return text.encode("utf-8")
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return None
        return b""  # UNUSED and types llama.cpp does not know decode to nothing

    def encode(self, text: str, parse_special: bool) -> list[int]:
        split = self.special if parse_special else self.user_defined
        out: list[int] = []
        start, after_special = 0, True
        for m in (split.finditer(text) if split else ()):
            if m.start() > start:
                self._encode_piece(text[start:m.start()], after_special, out)
            token = self.vocab[m.group()]
            out.append(token)
            start, after_special = m.end(), True
            if token in self.rstrip:
                while start < len(text) and text[start] in " \t\n\v\f\r":  # C's isspace
                    start += 1
        if start < len(text):
            self._encode_piece(text[start:], after_special, out)
        return out

    def _encode_piece(self, text: str, after_special: bool, out: list[int]) -> None:
        if self.add_space_prefix and after_special:
            text = " " + text
        sym = list(text.replace(" ", SPACE))  # the symbols: one per character, merged left into right
        n = len(sym)
        nxt, prev = list(range(1, n + 1)), list(range(-1, n - 1))
        nxt[-1] = -1
        vocab, scores, heap = self.vocab, self.scores, []

        def pair(left, right):
            t = vocab.get(sym[left] + sym[right])
            if t is not None:
                heapq.heappush(heap, (-scores[t], left, len(sym[left]) + len(sym[right])))

        for i in range(n - 1):
            pair(i, i + 1)
        while heap:
            _, left, size = heapq.heappop(heap)
            right = nxt[left]
            if not sym[left] or right < 0 or len(sym[left]) + len(sym[right]) != size:
                continue  # one of the two was merged since this pair was queued
            sym[left], sym[right] = sym[left] + sym[right], ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
                pair(left, nxt[left])
            if prev[left] >= 0:
                pair(prev[left], left)
        i = 0
        while i >= 0:
            t = vocab.get(sym[i])
            if t is not None:
                out.append(t)
            else:  # a character that is no token: its bytes
                for b in sym[i].encode("utf-8"):
                    if self.bytes[b] is None:
                        raise RequestError(f"character {sym[i]!r} is not in the vocabulary, which has no byte "
                                           f"token <0x{b:02X}> to spell it with")
                    out.append(self.bytes[b])
            i = nxt[i]

    def piece(self, token: int, special: bool) -> bytes:
        p = self.pieces[token]
        return p if p is not None else self.tokens[token].encode("utf-8") if special else b""

    def decode(self, ids: list[int], skip_special: bool) -> str:
        """llama.cpp's `llama_detokenize(remove_special=False, unparse_special=not skip_special)`: the
        space the encoder put before the text is taken off the first token again."""
        out = [self.piece(t, not skip_special) for t in ids]
        if self.add_space_prefix and out and out[0].startswith(b" "):
            out[0] = out[0][1:]
        return b"".join(out).decode("utf-8", errors="replace")


@dataclass(repr=False)
class GGUFTokenizer:
    """Encode/decode with a GGUF model's vocabulary. Build with `GGUFTokenizer.from_metadata`."""

    hf: Tokenizer | None  # byte-level BPE
    tokens: list[str]
    token_types: np.ndarray
    pre: str
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    eog_ids: frozenset[int] = field(default_factory=frozenset)
    add_eos: bool = False
    spm: SentencePiece | None = None  # a SentencePiece vocabulary, instead of `hf`

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_metadata(cls, meta: dict, source: str = "<metadata>") -> "GGUFTokenizer":
        model = typed_value(meta, "tokenizer.ggml.model", str, None, source)
        if model is None:
            raise GGUFError(f"{source}: missing metadata key 'tokenizer.ggml.model'")
        if model not in ("gpt2", "llama"):
            raise UnsupportedError(f"{source}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' "
                                   f"and SentencePiece 'llama' are)")
        pre = typed_value(meta, "tokenizer.ggml.pre", str, "default", source)
        if pre not in PRE_TOKENIZERS or (model == "llama" and pre != "default"):
            supported = "default" if model == "llama" else ", ".join(sorted(PRE_TOKENIZERS))
            raise UnsupportedError(f"{source}: pre-tokenizer {pre!r} is not supported with tokenizer model "
                                   f"{model!r} (supported: {supported})")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
            raise GGUFError(f"{source}: missing or empty string array 'tokenizer.ggml.tokens'")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(n, TOKEN_NORMAL, dtype=np.int32)
        elif isinstance(types, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in types):
            types = np.array(types, dtype=np.int64)  # a hand-built metadata dict; files give arrays
        if not isinstance(types, np.ndarray) or types.dtype.kind not in "iu":
            raise GGUFError(f"{source}: metadata key 'tokenizer.ggml.token_type' should be an integer array")
        if types.shape != (n,):
            raise GGUFError(
                f"{source}: tokenizer.ggml.token_type has {types.size} entries, expected {n} (one per token)"
            )

        def token_id(key):
            v = typed_value(meta, key, int, None, source)
            if v is None:
                return None
            if not 0 <= v < n:
                raise GGUFError(f"{source}: {key} = {v!r} is not a token id in [0, {n})")
            return v

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        eot = token_id("tokenizer.ggml.eot_token_id")

        looks_control = [i for i in np.nonzero(types != TOKEN_CONTROL)[0] if tokens[i] in CONTROL_LOOKING]
        if looks_control:  # llama.cpp makes these control tokens, whatever the file says
            types = types.copy()
            types[looks_control] = TOKEN_CONTROL
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:  # duplicate strings: keep the first id, as llama.cpp's text_to_token does
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
        eog = {i for i in (eos, eot) if i is not None}
        for i in np.nonzero(types == TOKEN_CONTROL)[0]:
            if tokens[i] in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>"):
                eog.add(int(i))
        common = dict(tokens=tokens, token_types=types, pre=pre, bos_id=bos, eos_id=eos,
                      add_bos=typed_value(meta, "tokenizer.ggml.add_bos_token", bool, model == "llama", source)
                      and bos is not None,
                      add_eos=typed_value(meta, "tokenizer.ggml.add_eos_token", bool, False, source)
                      and eos is not None,
                      chat_template=typed_value(meta, "tokenizer.chat_template", str, None, source),
                      eog_ids=frozenset(eog))
        if model == "llama":
            return cls(hf=None, spm=_sentencepiece(meta, source, tokens, types, vocab), **common)
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or (merges and not isinstance(merges[0], str)):
            raise GGUFError(f"{source}: missing string array 'tokenizer.ggml.merges'")
        pairs = []
        for i, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise GGUFError(f"{source}: merge #{i} {m!r} is not two tokens separated by a space")
            pairs.append((a, b))
        splits, ignore_merges = PRE_TOKENIZERS[pre]
        try:
            hf = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
        except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
            raise GGUFError(f"{source}: invalid BPE vocabulary: {str(e).splitlines()[0]}") from None
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        added = [
            AddedToken(tokens[i], special=bool(types[i] == TOKEN_CONTROL), normalized=False)
            for i in np.nonzero((types == TOKEN_CONTROL) | (types == TOKEN_USER_DEFINED))[0]
        ]
        if added:
            hf.add_tokens(added)
        return cls(hf=hf, **common)

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        `add_special` prepends BOS when the model asks for it; `parse_special` lets control tokens
        written in the text (`<|im_start|>`) become their ids, as chat templates need.
        """
        if not isinstance(text, str):
            raise RequestError(f"encode() takes str, got {type(text).__name__}")
        try:
            if self.spm is not None:
                text.encode("utf-8")  # a lone surrogate is no text
                ids = self.spm.encode(text, parse_special)
            else:
                self.hf.encode_special_tokens = not parse_special
                ids = self.hf.encode(text, add_special_tokens=False).ids
        except (TypeError, UnicodeEncodeError):  # only text that UTF-8 can encode: a lone surrogate is not
            bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
            if bad is None:
                raise
            raise RequestError(f"text is not valid Unicode: a lone surrogate U+{ord(text[bad]):04X} at "
                               f"character {bad}") from None
        if add_special and self.add_bos:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos:
            ids = ids + [self.eos_id]
        return ids

    def encode_parts(self, parts: list[tuple[str, bool]], add_special: bool = False) -> list[int]:
        """Token ids of the text of `parts`, each (text, parse_special) tokenized on its own and the ids
        joined (BOS and EOS, where `add_special` and the model ask, once around the whole): a chat
        prompt whose messages hold control-token text, kept as text while the template's are parsed."""
        ids = [t for text, special in parts if text for t in self.encode(text, parse_special=special)]
        if add_special and self.add_bos:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos:
            ids = ids + [self.eos_id]
        return ids

    @cached_property
    def _control(self) -> re.Pattern | None:
        ids = np.nonzero((self.token_types == TOKEN_CONTROL) | (self.token_types == TOKEN_UNKNOWN))[0]
        texts = sorted((self.tokens[i] for i in ids if self.tokens[i]), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def control_text(self, text: str) -> str | None:
        """The first control token written in `text` (what `parse_special` would make its id), or None."""
        m = self._control.search(text) if self._control is not None else None
        return m.group() if m else None

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of token ids; bytes that do not form complete UTF-8 become U+FFFD."""
        ids = token_ids(ids)
        for i in ids:
            if not 0 <= i < len(self.tokens):
                raise RequestError(f"token id {i} is outside the vocabulary [0, {len(self.tokens)})")
        if self.spm is not None:
            return self.spm.decode(ids, skip_special)
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """One token's own text, as llama.cpp's token_to_piece gives it (the server's logprobs): a
        SentencePiece token keeps its leading space, which `decode` takes off the text's first token."""
        if self.spm is None:
            return self.decode([token_id])
        self.decode([token_id])  # (the id checked)
        return self.spm.piece(token_id, True).decode("utf-8", errors="replace")

    def decode_stream(self) -> "TextStream":
        """An incremental detokenizer: feed generated ids one at a time, get text deltas back."""
        return TextStream(self)

    def is_special(self, token_id: int) -> bool:
        return bool(self.token_types[token_id] == TOKEN_CONTROL)

    def __repr__(self) -> str:  # its summary: the dataclass's own would print the whole vocabulary (~500 KB)
        return f"GGUFTokenizer({self.summary()})"

    def summary(self) -> str:
        n_ctrl = int(np.sum(self.token_types == TOKEN_CONTROL))
        n_user = int(np.sum(self.token_types == TOKEN_USER_DEFINED))

        def name(i):
            return "none" if i is None else f"{i} {self.tokens[i]!r}"

        kind = "SentencePiece" if self.spm is not None else "byte-level BPE"
        return (
            f"{kind}, {self.vocab_size} tokens ({n_ctrl} control, {n_user} user-defined), "
            f"pre-tokenizer {self.pre!r}, BOS {name(self.bos_id)}{' (added)' if self.add_bos else ''}, "
            f"EOS {name(self.eos_id)}, chat template {'yes' if self.chat_template else 'no'}"
        )


class TextStream:
    """Incremental detokenization with `tokenizers.decoders.DecodeStream`: constant work per token (it
    decodes a short window of recent ids, never the whole output). A token that ends inside a UTF-8
    character gives "" until the character is complete; control tokens give "" (skipped).

    A SentencePiece vocabulary streams llama.cpp's pieces (the text llama.cpp's server sends) through an
    incremental UTF-8 decoder: generated text continues a prompt, so its first space is kept."""

    def __init__(self, tokenizer: GGUFTokenizer):
        self._hf, self._spm = tokenizer.hf, tokenizer.spm
        if self._spm is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._stream = decoders.DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        if self._spm is not None:
            return self._utf8.decode(self._spm.piece(int(token_id), special=False))
        return self._stream.step(self._hf, int(token_id)) or ""


def _sentencepiece(meta: dict, source: str, tokens: list[str], types: np.ndarray,
                   vocab: dict[str, int]) -> SentencePiece:
    """The SentencePiece half of `from_metadata`: scores, the space prefix, and the whitespace that
    llama.cpp strips after Phi-3's special tokens (it decides that by the model's name, as here)."""
    scores = meta.get("tokenizer.ggml.scores")
    if isinstance(scores, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores):
        scores = np.array(scores, dtype=np.float32)  # a hand-built metadata dict; files give arrays
    if not isinstance(scores, np.ndarray) or scores.dtype.kind != "f":
        raise GGUFError(f"{source}: a SentencePiece vocabulary needs the float array 'tokenizer.ggml.scores'")
    if scores.shape != (len(tokens),):
        raise GGUFError(f"{source}: tokenizer.ggml.scores has {scores.size} entries, expected {len(tokens)} "
                        f"(one per token)")
    bad = next((i for i in np.nonzero(types == TOKEN_BYTE)[0] if not re.fullmatch("<0x[0-9A-F]{2}>", tokens[i])), None)
    if bad is not None:
        raise GGUFError(f"{source}: byte token {bad} is {tokens[bad]!r}, not <0xNN>")
    name = typed_value(meta, "general.name", str, "", source).lower()
    rstrip = frozenset()
    if "phi-3" in name or "phi3" in name:  # llama-vocab.cpp: every special token but these three
        special = (types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN) | (types == TOKEN_USER_DEFINED)
        keep = {vocab.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
        rstrip = frozenset(int(i) for i in np.nonzero(special)[0] if int(i) not in keep)
    return SentencePiece(tokens, scores, types, vocab,
                         typed_value(meta, "tokenizer.ggml.add_space_prefix", bool, True, source), rstrip)


def load_tokenizer(path: str | os.PathLike) -> GGUFTokenizer:
    """The tokenizer of a GGUF file (a full model or a vocabulary-only file)."""
    with GGUFFile(path) as g:
        return GGUFTokenizer.from_metadata(g.metadata, source=str(path))
