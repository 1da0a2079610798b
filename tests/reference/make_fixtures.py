"""Make the committed reference fixtures with llama.cpp (llama-cpp-python), all in float32.

    python -m venv /tmp/refenv && /tmp/refenv/bin/pip install llama-cpp-python numpy gguf
    PYTHONPATH=. /tmp/refenv/bin/python tests/reference/make_fixtures.py [SMOLLM2_Q4_1.gguf]
    (TOKENIZER_ONLY=1 remakes only tokenizer_vectors.json, SPM_ONLY=1 only its SentencePiece part,
    ONLY=name,... only those synthetic fixtures; on this
    project's VM llama-cpp-python must be built with CMAKE_ARGS="-DGGML_NATIVE=OFF": the native build dies with SIGILL)

For each model: dequantize every tensor to F32 (`mlxinfer.synthetic.write_f32_copy`), run llama.cpp with
an F32 KV cache (type_k = type_v = 0) so that no activation is quantized, and record
  - the prompt's token ids and the logits at every prompt position (one prefill),
  - the greedy continuation (one token per decode step) and, at each step, the reference's top-2 gap.
CI never runs this: it compares our engine against the .npz files it wrote.
"""

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from mlxinfer.synthetic import rewrite_gguf, write_f32_copy, write_synthetic_model  # noqa: E402
from tests.reference.specs import (QWEN3_PROMPT_IDS, QWEN3_SYNTHETIC, SMOLLM2_PROMPT, SYNTHETIC_PROMPTS,  # noqa: E402
                                   synthetic_files)

HERE = os.path.dirname(os.path.abspath(__file__))
N_GREEDY = 48


def greedy_decode(llm, prompt_ids, n):
    """Prefill `prompt_ids` from an empty cache, then n greedy decode steps: (prompt logits, tokens,
    the reference's top-2 gap at each step)."""
    llm.reset()
    llm.eval(prompt_ids)
    prompt_logits = np.array(llm.scores[: len(prompt_ids)], dtype=np.float32)
    greedy, gaps = [], []
    logits = prompt_logits[-1]
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        tok = int(np.argmax(logits))
        greedy.append(tok)
        gaps.append(float(top2[1] - top2[0]))
        if tok == llm.token_eos():
            break
        llm.eval([tok])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return prompt_logits, greedy, gaps


def reference(path, prompt_ids, out_name, more_prompts=(), n_greedy=N_GREEDY):
    """The fixture `out_name`: logits at every position of `prompt_ids` and its greedy continuation;
    for each of `more_prompts` (k = 1, 2, ...) its greedy continuation as `greedy_k`, `top2_gap_k`."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, logits_all=True, type_k=0, type_v=0,
                          n_threads=2, verbose=False)
    prompt_logits, greedy, gaps = greedy_decode(llm, prompt_ids, n_greedy)
    more = {}
    for k, ids in enumerate(more_prompts, 1):
        _, toks, gk = greedy_decode(llm, ids, n_greedy)
        more.update({f"prompt_ids_{k}": np.array(ids, dtype=np.int64), f"greedy_{k}": np.array(toks, dtype=np.int64),
                     f"top2_gap_{k}": np.array(gk, dtype=np.float32)})
        print(out_name, f"prompt {k}", len(ids), "greedy", toks[:16], "min gap", min(gk))
    np.savez_compressed(os.path.join(HERE, out_name), prompt_ids=np.array(prompt_ids, dtype=np.int64),
                        prompt_logits=prompt_logits, greedy=np.array(greedy, dtype=np.int64),
                        top2_gap=np.array(gaps, dtype=np.float32), eos=llm.token_eos(),
                        engine=f"llama-cpp-python {llama_cpp.__version__}", **more)
    print(out_name, "prompt", len(prompt_ids), "greedy", greedy[:16], "min gap", min(gaps))


EXTRA_TEXTS = ["1234567 3.14159 10,000,000", "I'll've we'RE they'D", "def f(x):\n\treturn x**2  # ok\n",
               "中文测试 日本語 한국어", "Ünïcödé ß ﬁ ǅ", "  leading and trailing  ", "a\r\nb\n\n\nc",
               "<|im_start|>user hi<|im_end|>", "emoji 🦙🦙 and 🇫🇷", "$100+200=300 ~^|<>",
               # case-insensitive contractions, and the [\r\n]* that follows punctuation
               "DON'TS", "I'M SURE YOU'LL SEE WE'VE HE'D", "The end.\n", "Stop.\n\nGo!\r\n", "x!!\n\n\ny",
               'He said: "yes".\n', "(a) [b] {c}\n\t- d", "9999 99 999999999"]


def vocabularies(smollm2_path):
    """The vocabularies the tokenizer vectors are made with: SmolLM2's (49,152 tokens), the real
    Qwen2/Qwen3 one (151,936, from llama.cpp's test data), and a synthetic one that holds a token no
    merge can reach (where llama-bpe's ignore_merges shows)."""
    return {"smollm2": smollm2_path, "qwen2": os.path.join(HERE, "..", "data", "ggml-vocab-qwen2.gguf")}


def unreachable_token_vocab(tmp):
    """A synthetic vocabulary with the token "Ġzq" but no merge that builds it: with ignore_merges
    (llama-bpe) the word " zq" is that one token, without it two."""
    from mlxinfer.synthetic import write_synthetic_model

    src = write_synthetic_model(os.path.join(tmp, "syn.gguf"), arch="llama", n_layers=1)
    from mlxinfer.gguf_file import GGUFFile

    with GGUFFile(src) as g:
        tokens = list(g.metadata["tokenizer.ggml.tokens"])
        types = np.array(g.metadata["tokenizer.ggml.token_type"])
    filler = next(i for i, t in enumerate(tokens) if t.startswith("<|filler_"))
    tokens[filler], types[filler] = "\u0120zq", 1
    return rewrite_gguf(src, os.path.join(tmp, "unreachable.gguf"), tensors=False,
                        edits={"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types.astype(np.int32)})


def tokenizer_vectors(smollm2_path, tmp):
    """llama.cpp's tokenization of llama.cpp's own test inputs plus ours, with each vocabulary under
    every pre-tokenizer name mlxinfer registers (one vocab-only copy per pair), BOS added where the
    file asks for it, and the ignore_merges case."""
    import json

    import llama_cpp

    from mlxinfer.tokenizer import PRE_TOKENIZERS

    inputs = open(os.path.join(HERE, "..", "data", "ggml-vocab-qwen2.gguf.inp"), encoding="utf-8").read()
    texts = inputs.split("\n__ggml_vocab_test__\n")[:-1] + EXTRA_TEXTS
    out = {"texts": texts, "ids": {}, "add_bos": {}, "ignore_merges": {}}

    def tokenize(path, text, add_bos=False):
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        return [llm.tokenize(t.encode("utf-8"), add_bos=add_bos, special=False) for t in text]

    for vocab, path in vocabularies(smollm2_path).items():
        for pre in PRE_TOKENIZERS:
            copy = rewrite_gguf(path, os.path.join(tmp, f"{vocab}-{pre}.gguf"), edits={"tokenizer.ggml.pre": pre},
                                tensors=False)
            out["ids"][f"{vocab}/{pre}"] = tokenize(copy, texts)
        copy = rewrite_gguf(path, os.path.join(tmp, f"{vocab}-bos.gguf"), tensors=False,
                            edits={"tokenizer.ggml.add_bos_token": True})
        out["add_bos"][vocab] = tokenize(copy, texts[:8], add_bos=True)
    syn = unreachable_token_vocab(tmp)
    for pre in ("llama-bpe", "gpt-2"):
        copy = rewrite_gguf(syn, os.path.join(tmp, f"syn-{pre}.gguf"), edits={"tokenizer.ggml.pre": pre},
                            tensors=False)
        out["ignore_merges"][pre] = tokenize(copy, [" zq", "a zq b"])
    with open(os.path.join(HERE, "tokenizer_vectors.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)
    print("tokenizer vectors:", len(texts), "texts x", len(out["ids"]), "vocabulary/pre-tokenizer pairs;",
          "ignore_merges:", out["ignore_merges"])


def synthetic_references(tmp, only=None):
    """Each synthetic file's fixture (three prompts, 32 greedy tokens); `only`: a list of fixture names."""
    first, *more = SYNTHETIC_PROMPTS
    for name, path in synthetic_files(tmp).items():
        if not only or name in only:
            reference(path, first, name + ".npz", more, n_greedy=32)


SPM_VOCABS = ("llama-spm", "phi-3")
SPM_TEXTS = ["", " ", "   x  y", "a\n\nb\n", "\t tab\t", "Hello World", " Hello", "multiple     spaces   here  ",
             "emoji 🦙🦙 and 🇫🇷 👩‍👩‍👧", "\U00020000 \u9fff \uac00\ud7a3", "中文测试 日本語 한국어", "Ünïcödé ß ﬁ ǅ",
             "a\u3000b\u00a0c",
             "<s> hi</s>  x", "a <unk> b", "<0x41> <0x0A>", "<|user|>\n hi<|end|>\n<|assistant|>",
             "<|system|>You are\t<|end|>  <|placeholder1|>x", "[PAD32011] y", "▁already▁escaped", "\x00\x7f\r\n"]


def spm_vectors(tmp):
    """llama.cpp on the two SentencePiece vocabularies (tests/data/ggml-vocab-{llama-spm,phi-3}.gguf):
    ids with and without special-token parsing, with BOS/EOS added, and the text llama.cpp's
    llama_detokenize (unparse_special both ways) and token_to_piece give back. Written into
    tokenizer_vectors.json under "spm".

    The two .gguf files are llama.cpp's models/ggml-vocab-{llama-spm,phi-3}.gguf rebuilt with gguf's
    writer from a copy whose bytes had passed through a UTF-8 'replace' decode: strings and token types
    survived; each score was the candidate (-(id - 259), -1e9, -1000, -10000, 0) whose bytes mangle to the
    bytes found, every one of the 32,000/32,064 matched and the lengths added up. Checked: llama-cpp-python
    on the rebuilt files gives llama.cpp's .out for all 46 .inp texts of each."""
    import ctypes
    import json

    import llama_cpp

    out = {"texts": SPM_TEXTS}
    for name in SPM_VOCABS:
        path = os.path.join(HERE, "..", "data", f"ggml-vocab-{name}.gguf")
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)

        def detokenize(ids, unparse_special):
            buf = ctypes.create_string_buffer(1 << 16)
            n = llama_cpp.llama_detokenize(vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buf, len(buf),
                                           False, unparse_special)
            return buf.raw[:n].decode("utf-8", errors="replace")

        def piece(i):
            buf = ctypes.create_string_buffer(256)
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
            return buf.raw[:n].decode("latin-1")  # bytes, one per latin-1 character

        v = out[name] = {"plain": [], "special": [], "add_special": [], "decode": [], "decode_skip": [], "pieces": []}
        for t in SPM_TEXTS:
            ids = llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)
            special = llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)
            v["plain"].append(ids)
            v["special"].append(special)
            v["add_special"].append(llm.tokenize(t.encode("utf-8"), add_bos=True, special=False))
            v["decode"].append(detokenize(special, True))
            v["decode_skip"].append(detokenize(special, False))
            v["pieces"].append([piece(i) for i in special])
        eos = rewrite_gguf(path, os.path.join(tmp, f"{name}-eos.gguf"), tensors=False,
                           edits={"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_space_prefix": False})
        llm = llama_cpp.Llama(model_path=eos, vocab_only=True, verbose=False)
        v["no_prefix_add_eos"] = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in SPM_TEXTS]
    target = os.path.join(HERE, "tokenizer_vectors.json")
    with open(target, encoding="utf-8") as f:
        vectors = json.load(f)
    vectors["spm"] = out
    with open(target, "w", encoding="utf-8") as f:
        json.dump(vectors, f, ensure_ascii=False)
    print("spm vectors:", len(SPM_TEXTS), "texts x", SPM_VOCABS)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        only_tokenizer = bool(os.environ.get("TOKENIZER_ONLY"))  # remake tokenizer_vectors.json alone
        if os.environ.get("SPM_ONLY"):  # remake only its SentencePiece part
            return spm_vectors(tmp)
        if os.environ.get("ONLY"):  # ONLY=gemma3_synthetic,gemma2_synthetic remakes those alone
            return synthetic_references(tmp, os.environ["ONLY"].split(","))
        if not only_tokenizer:
            q3 = write_synthetic_model(os.path.join(tmp, "q3.gguf"), QWEN3_SYNTHETIC)
            reference(write_f32_copy(q3, os.path.join(tmp, "q3_f32.gguf")), QWEN3_PROMPT_IDS, "qwen3_synthetic.npz")
            synthetic_references(tmp)
        if len(sys.argv) > 1:
            import llama_cpp

            vocab = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
            ids = vocab.tokenize(SMOLLM2_PROMPT.encode("utf-8"), add_bos=True, special=True)
            tokenizer_vectors(sys.argv[1], tmp)
            if only_tokenizer:
                return
            reference(write_f32_copy(sys.argv[1], os.path.join(tmp, "smol_f32.gguf")), ids, "smollm2.npz")


if __name__ == "__main__":
    main()
