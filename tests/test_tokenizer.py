import json
import os

import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import GGUFError, RequestError, UnsupportedError
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.tokenizer import PRE_TOKENIZERS, GGUFTokenizer

from .conftest import DATA, QWEN2_VOCAB, REFERENCE


def read_llama_cpp_vectors(stem):
    with open(os.path.join(DATA, stem + ".inp"), encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")[:-1]
    with open(os.path.join(DATA, stem + ".out"), encoding="utf-8") as f:
        ids = [[int(x) for x in line.split()] for line in f.read().split("\n")]
    return texts, ids[: len(texts)]


@pytest.fixture(scope="module")
def qwen2_tok():
    return mlxinfer.load_tokenizer(QWEN2_VOCAB)


def test_qwen2_vocab_reproduces_llama_cpp_test_vectors(qwen2_tok):
    texts, expected = read_llama_cpp_vectors("ggml-vocab-qwen2.gguf")
    assert len(texts) == 46
    for text, ids in zip(texts, expected):
        assert qwen2_tok.encode(text) == ids, repr(text)


def test_qwen2_vocab_decode_round_trips_utf8(qwen2_tok):
    texts, _ = read_llama_cpp_vectors("ggml-vocab-qwen2.gguf")
    for text in texts + ["Äpfel 🦙 нещо 中文", "\x00\x7f tabs\t\tand\r\nCRLF"]:
        assert qwen2_tok.decode(qwen2_tok.encode(text)) == text


def test_qwen2_vocab_metadata(qwen2_tok):
    assert qwen2_tok.vocab_size == 151936
    assert qwen2_tok.pre == "qwen2"
    assert qwen2_tok.eos_id == 151643 and qwen2_tok.tokens[151643] == "<|endoftext|>"
    assert not qwen2_tok.add_bos
    assert 151643 in qwen2_tok.eog_ids and 151645 in qwen2_tok.eog_ids


def test_control_tokens_parse_only_when_asked(qwen2_tok):
    text = "<|im_start|>user\nhi<|im_end|>"
    special = qwen2_tok.encode(text, parse_special=True)
    assert special[0] == 151644 and special[-1] == 151645
    plain = qwen2_tok.encode(text)
    assert 151644 not in plain and 151645 not in plain
    assert qwen2_tok.decode(special) == text
    assert qwen2_tok.decode(special, skip_special=True) == "user\nhi"


def test_user_defined_tokens_always_match(qwen2_tok):
    # type-4 (user-defined) tokens are matched even without parse_special, as in llama.cpp
    assert qwen2_tok.encode("x[PAD151650]y") == [87, 151650, 88]


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_path):
    with GGUFFile(smollm2_path) as g:
        return dict(g.metadata)


@pytest.fixture(scope="module")
def vectors():
    with open(os.path.join(REFERENCE, "tokenizer_vectors.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def vocab_meta(smollm2_meta):
    with GGUFFile(QWEN2_VOCAB) as g:
        return {"smollm2": smollm2_meta, "qwen2": dict(g.metadata)}


def test_every_registered_pre_tokenizer_matches_llama_cpp_on_two_vocabularies(vectors, vocab_meta):
    """Each of the 21 pre-tokenizer names with SmolLM2's and the Qwen2 vocabulary, on llama.cpp's test
    inputs plus texts that separate the variants (case-insensitive contractions such as DON'TS, the
    [\\r\\n]* after punctuation in "end.\\n", digit grouping), against llama.cpp's own tokenization
    (tests/reference/make_fixtures.py records it with llama-cpp-python)."""
    assert {key.split("/")[1] for key in vectors["ids"]} == set(PRE_TOKENIZERS)
    assert {key.split("/")[0] for key in vectors["ids"]} == {"smollm2", "qwen2"}
    for text in ("DON'TS", "The end.\n"):
        assert text in vectors["texts"]
    for key, expected in vectors["ids"].items():
        vocab, pre = key.split("/")
        tok = GGUFTokenizer.from_metadata({**vocab_meta[vocab], "tokenizer.ggml.pre": pre})
        for text, ids in zip(vectors["texts"], expected):
            assert tok.encode(text) == ids, (key, text)


def test_bos_is_added_when_the_file_asks(vectors, vocab_meta):
    for vocab, expected in vectors["add_bos"].items():
        tok = GGUFTokenizer.from_metadata({**vocab_meta[vocab], "tokenizer.ggml.add_bos_token": True})
        assert tok.add_bos and tok.bos_id is not None
        for text, ids in zip(vectors["texts"], expected):
            assert ids[0] == tok.bos_id
            assert tok.encode(text, add_special=True) == ids, (vocab, text)
            assert tok.encode(text, add_special=False) == ids[1:]


def test_llama_bpe_ignores_merges_as_llama_cpp_does(vectors, tmp_path):
    """A vocabulary holding a token no merge can build: llama-bpe takes the whole word when it is in the
    vocabulary (ignore_merges), gpt-2 does not."""
    from tests.reference.make_fixtures import unreachable_token_vocab

    with GGUFFile(unreachable_token_vocab(str(tmp_path))) as g:
        meta = dict(g.metadata)
    for pre, expected in vectors["ignore_merges"].items():
        tok = GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": pre})
        assert [tok.encode(t) for t in (" zq", "a zq b")] == expected, pre
    assert vectors["ignore_merges"]["llama-bpe"] != vectors["ignore_merges"]["gpt-2"]


def test_pre_tokenizers_differ_where_llama_cpp_differs(smollm2_meta):
    # digits: smollm/starcoder split every digit, llama-bpe groups by 3, gpt-2 keeps the run
    def pieces(pre):
        tok = GGUFTokenizer.from_metadata({**smollm2_meta, "tokenizer.ggml.pre": pre})
        return [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str("x 1234567")]

    assert pieces("smollm") == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert pieces("llama-bpe") == ["x", "Ġ", "123", "456", "7"]
    assert pieces("gpt-2") == ["x", "Ġ1234567"]


def test_unknown_pre_tokenizer_is_a_clear_error(smollm2_meta):
    with pytest.raises(UnsupportedError, match="pre-tokenizer 'nonesuch' is not supported"):
        GGUFTokenizer.from_metadata({**smollm2_meta, "tokenizer.ggml.pre": "nonesuch"}, source="f.gguf")
    assert "qwen2" in PRE_TOKENIZERS


def test_smollm2_bos_eos_and_template(smollm2_meta):
    tok = GGUFTokenizer.from_metadata(smollm2_meta)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    assert tok.tokens[2] == "<|im_end|>"
    assert "<|im_start|>" in tok.chat_template


def test_hand_built_metadata_takes_numpy_scalars_and_a_list_of_types(smollm2_meta):
    """A metadata dict built in Python (not read from a file) may hold numpy scalars and a list of
    token types; a file's wrong types are refused (tests/malformed.py)."""
    meta = {**smollm2_meta, "tokenizer.ggml.eos_token_id": np.int32(2), "tokenizer.ggml.add_bos_token": np.True_,
            "tokenizer.ggml.token_type": [int(t) for t in smollm2_meta["tokenizer.ggml.token_type"]]}
    tok = GGUFTokenizer.from_metadata(meta)
    assert (tok.eos_id, tok.add_bos) == (2, True) and type(tok.eos_id) is int
    assert np.array_equal(tok.token_types, smollm2_meta["tokenizer.ggml.token_type"])
    with pytest.raises(GGUFError, match="'tokenizer.ggml.eos_token_id' should be int, found float"):
        GGUFTokenizer.from_metadata({**smollm2_meta, "tokenizer.ggml.eos_token_id": np.float32(2)})


# SentencePiece (tokenizer.ggml.model = llama): llama.cpp's two SPM test vocabularies, Llama 2's 32,000
# tokens and Phi-3's 32,064 (the same pieces plus control tokens, a user-defined </s>, 53 unknown pads).
SPM_VOCABS = ("llama-spm", "phi-3")


@pytest.fixture(scope="module")
def spm():
    return {name: mlxinfer.load_tokenizer(os.path.join(DATA, f"ggml-vocab-{name}.gguf")) for name in SPM_VOCABS}


def test_a_tokens_own_text_keeps_its_leading_space(spm, qwen2_tok):
    """`token_text` (the server's logprobs) is llama.cpp's token_to_piece: " Hello" for SentencePiece's
    "▁Hello", which `decode([id])` gives as "Hello" (the encoder's added space taken off); control
    tokens by name; byte-level BPE as decode."""
    tok = spm["llama-spm"]
    (hello,) = tok.encode("Hello")
    assert tok.decode([hello]) == "Hello" and tok.token_text(hello) == " Hello"
    assert [tok.token_text(t) for t in tok.encode("Hello world")] == [" Hello", " world"]
    assert tok.token_text(tok.bos_id) == "<s>"
    (paris,) = qwen2_tok.encode(" Paris")
    assert qwen2_tok.token_text(paris) == qwen2_tok.decode([paris]) == " Paris"
    with pytest.raises(RequestError, match="token id 32000 is outside the vocabulary"):
        tok.token_text(32000)


@pytest.mark.parametrize("name", SPM_VOCABS)
def test_sentencepiece_vocab_reproduces_llama_cpp_test_vectors(spm, name):
    texts, expected = read_llama_cpp_vectors(f"ggml-vocab-{name}.gguf")
    assert len(texts) == 46
    for text, ids in zip(texts, expected):
        assert spm[name].encode(text) == ids, repr(text)
        assert spm[name].decode(ids) == text, repr(text)


@pytest.mark.parametrize("name", SPM_VOCABS)
def test_sentencepiece_hard_cases_match_llama_cpp(spm, vectors, name):
    """Byte fallback (a CJK extension-B character, U+9FFF, Hangul, emoji sequences), runs of spaces,
    newlines and tabs, special tokens written in text (parsed only when asked; Phi-3's strip the
    whitespace after them), BOS/EOS added, add_space_prefix off, and the text llama.cpp decodes: all
    as llama-cpp-python gave them (tests/reference/make_fixtures.py, SPM_ONLY=1)."""
    tok, v = spm[name], vectors["spm"][name]
    texts = vectors["spm"]["texts"]
    for i, text in enumerate(texts):
        assert tok.encode(text) == v["plain"][i], text
        assert tok.encode(text, parse_special=True) == v["special"][i], text
        assert tok.encode(text, add_special=True) == v["add_special"][i], text
        assert tok.decode(v["special"][i]) == v["decode"][i], text
        assert tok.decode(v["special"][i], skip_special=True) == v["decode_skip"][i], text
        stream = tok.decode_stream()
        streamed = "".join(stream.step(t) for t in v["special"][i])
        assert streamed == "".join(v["pieces"][i]).encode("latin-1").decode("utf-8", errors="replace"), text
    with GGUFFile(os.path.join(DATA, f"ggml-vocab-{name}.gguf")) as g:
        meta = {**g.metadata, "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_space_prefix": False}
    tok = GGUFTokenizer.from_metadata(meta)
    for text, ids in zip(texts, v["no_prefix_add_eos"]):
        assert tok.encode(text, add_special=True) == ids, text


def test_sentencepiece_hard_cases_are_the_cases_named(spm, vectors):
    """The vectors hold what they are said to: byte tokens for characters outside the vocabulary, a
    merged run of spaces, control tokens only with parse_special, Phi-3's stripped whitespace."""
    tok, texts = spm["llama-spm"], vectors["spm"]["texts"]
    ids = tok.encode("\U00020000")
    assert [tok.tokens[i] for i in ids] == ["▁", "<0xF0>", "<0xA0>", "<0x80>", "<0x80>"]
    assert tok.decode(ids) == "\U00020000"
    assert [tok.tokens[i] for i in tok.encode("   x")] == ["▁▁▁", "▁x"]  # the space prefix, then merges
    assert tok.encode("<s>a</s>", parse_special=True) == [1, 263, 2]
    assert 1 not in tok.encode("<s>a</s>") and 2 not in tok.encode("<s>a</s>")
    phi3 = spm["phi-3"]
    assert phi3.encode("<|user|>\n hi", parse_special=True) == [32010] + phi3.encode("hi")
    assert "<|user|>\n hi<|end|>\n<|assistant|>" in texts and "\U00020000 \u9fff \uac00\ud7a3" in texts


def test_sentencepiece_round_trips_text(spm, vectors):
    """Every text but one holding U+2581 itself, which decodes as a space (in llama.cpp too: the
    vectors' "decode" of '▁already▁escaped')."""
    texts = [t for t in vectors["spm"]["texts"] if "\u2581" not in t]
    assert len(texts) == len(vectors["spm"]["texts"]) - 1
    for name in SPM_VOCABS:
        for text in texts + ["Äpfel 🦙 нещо 中文", "  two\n\n  lines  "]:
            assert spm[name].decode(spm[name].encode(text)) == text, (name, text)
        assert spm[name].decode(spm[name].encode("a▁b")) == "a b"


def test_sentencepiece_refusals(spm):
    with GGUFFile(os.path.join(DATA, "ggml-vocab-llama-spm.gguf")) as g:
        meta = dict(g.metadata)
    with pytest.raises(UnsupportedError, match="pre-tokenizer 'qwen2' is not supported with tokenizer model 'llama'"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(GGUFError, match="needs the float array 'tokenizer.ggml.scores'"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.scores": None})
    with pytest.raises(GGUFError, match="scores has 3 entries, expected 32000"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.scores": [0.0, 0.0, 0.0]})
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[3 + 0xF0] = "<0xf0>"
    with pytest.raises(GGUFError, match="byte token 243 is '<0xf0>', not <0xNN>"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens})
    types = np.array(meta["tokenizer.ggml.token_type"])
    types[3:259] = 5  # no byte tokens: a character outside the vocabulary cannot be spelled
    renamed = [f"b{i}" if 3 <= i < 259 else t for i, t in enumerate(meta["tokenizer.ggml.tokens"])]
    no_bytes = GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.token_type": types, "tokenizer.ggml.tokens": renamed})
    with pytest.raises(RequestError, match="character '🦙' is not in the vocabulary, which has no byte token <0xF0>"):
        no_bytes.encode("a 🦙")
    with pytest.raises(RequestError, match="lone surrogate U\\+D800"):
        spm["llama-spm"].encode("a\ud800")
    assert spm["llama-spm"].summary().startswith("SentencePiece, 32000 tokens")


def test_sentencepiece_model_generates_end_to_end(tmp_path):
    """A synthetic llama file with Llama 2's vocabulary loads through the engine and `mlxinfer generate`
    prints text; the engine's prompt ids are llama.cpp's (BOS added, as the file asks)."""
    from mlxinfer.synthetic import SyntheticSpec, rewrite_gguf, write_synthetic_model

    from .test_cli import run_cli

    with GGUFFile(os.path.join(DATA, "ggml-vocab-llama-spm.gguf")) as g:
        vocab = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
    src = write_synthetic_model(tmp_path / "syn.gguf", SyntheticSpec(arch="llama", n_layers=1, vocab_size=32000))
    edits = {"tokenizer.ggml.merges": None, "tokenizer.chat_template": None, **vocab}
    path = rewrite_gguf(src, tmp_path / "spm.gguf", edits=edits)
    engine = mlxinfer.load(path, backend="cpu")
    assert engine.tokenizer.spm is not None
    gen = engine.generate("Hello world", max_tokens=4)
    assert gen.prompt_ids == [1, 15043, 3186] and len(gen.token_ids) <= 4
    assert gen.text == "".join(engine.tokenizer.decode_stream().step(t) for t in gen.token_ids)
    r = run_cli("generate", "--model", path, "--backend", "cpu", "--max-tokens", "4", "--quiet", "Hello world")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


@pytest.mark.parametrize("name", SPM_VOCABS)
def test_sentencepiece_matches_llama_cpp_on_random_text(spm, name):
    """Random strings of spaces, letters, tabs, newlines, CJK, emoji, U+3000, U+2581 and special-token
    texts, with and without parse_special, against llama-cpp-python itself (skipped where it is absent;
    4,000 strings per vocabulary gave no difference on 2026-12-01, 300 here)."""
    import random

    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=os.path.join(DATA, f"ggml-vocab-{name}.gguf"), vocab_only=True, verbose=False)
    rng = random.Random(7)
    alphabet = [" "] * 6 + list("abcdeinorst.,\n\t") + ["中", "🦙", "é", "\u3000", "\U00020000", "\u2581"]
    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|end|>", "[PAD32011]", "<0x41>"]
    for _ in range(300):
        text = "".join(rng.choice(specials) if rng.random() < 0.3 else
                       "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20))) for _ in range(rng.randint(1, 6)))
        for parse_special in (False, True):
            assert spm[name].encode(text, add_special=True, parse_special=parse_special) == \
                llm.tokenize(text.encode("utf-8"), add_bos=True, special=parse_special), (text, parse_special)


def test_streamed_text_never_splits_a_character(qwen2_tok):
    """The streaming detokenizer hands out a character only when its last byte has come: a text of
    emoji, skin-tone and ZWJ sequences, CJK and accents, whose characters byte-level BPE splits over
    several tokens, streams with no U+FFFD at any step and joins to the decoded text; a control token
    streams as "" (never printed)."""
    tok = qwen2_tok
    text = "Hi 😀👍🏽 👩‍👩‍👧 你好, 𠀋 café<|im_end|> ok 🫠"
    ids = tok.encode(text, parse_special=True)
    alone = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in a for a in alone) >= 4  # the case is real: these tokens end inside a character
    stream = tok.decode_stream()
    deltas = [stream.step(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == tok.decode(ids, skip_special=True) == text.replace("<|im_end|>", "")
    end = ids.index(tok.tokens.index("<|im_end|>"))
    assert deltas[end] == ""


def _qwen2_metadata():
    with GGUFFile(QWEN2_VOCAB) as g:
        return dict(g.metadata)


def test_end_of_turn_from_the_file_id():
    """The file's tokenizer.ggml.eot_token_id ends generation whatever the token's name (llama.cpp's
    special_eot_id), as EOS does; without it that token does not."""
    meta = _qwen2_metadata()
    odd = meta["tokenizer.ggml.tokens"].index("<|im_start|>")  # a control token no end-of-turn name
    assert odd not in GGUFTokenizer.from_metadata(meta).eog_ids
    tok = GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.eot_token_id": odd})
    assert odd in tok.eog_ids and tok.eos_id in tok.eog_ids


def test_duplicate_token_strings_take_the_first_id():
    """A vocabulary listing one string twice encodes it as the first id (llama.cpp's text_to_token
    keeps the first)."""
    meta = _qwen2_metadata()
    tokens = list(meta["tokenizer.ggml.tokens"])
    first, later = tokens.index("Hello"), len(tokens)  # a second "Hello" after the last token
    types = np.append(meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.token_type"][first])
    tok = GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens + ["Hello"],
                                       "tokenizer.ggml.token_type": types})
    assert tok.encode("Hello") == [first]
    assert tok.decode([first]) == "Hello" and later not in tok.encode("Hello Hello")


@pytest.mark.parametrize("name", ["qwen2", "llama-spm"])
def test_decode_refuses_the_first_id_past_the_vocabulary(name):
    """decode takes ids 0 .. vocab_size - 1 and names any other in one line, on both kinds of vocabulary
    (the first id past the end is where an off-by-one would decode "" or raise an IndexError)."""
    tok = mlxinfer.load_tokenizer(os.path.join(DATA, f"ggml-vocab-{name}.gguf"))
    assert isinstance(tok.decode([tok.vocab_size - 1]), str)
    for bad in (tok.vocab_size, -1):
        with pytest.raises(RequestError, match=rf"token id {bad} is outside the vocabulary \[0, {tok.vocab_size}\)"):
            tok.decode([5, bad])
