import json
import os

import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import GGUFError, UnsupportedError
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
