"""mlx-lm's OpenAI-compatible server (`mlx_lm.server`) as a serving peer, on our GGUF's weights.

    python3 bench/mlx_lm_server_peer.py MODEL.gguf OUT_DIR                 # write OUT_DIR, check token ids
    python3 bench/mlx_lm_server_peer.py MODEL.gguf OUT_DIR --serve --port 8792 [-- MLX_LM_SERVER_FLAGS...]
    python3 bench/serve_bench.py --url http://127.0.0.1:8792/v1 --model-id default_model ...

OUT_DIR is an mlx-lm model directory: `config.json` + `model.safetensors` from
`mlxinfer.peers.write_mlx_lm_model` (the same quantization: Q8_0/Q4_0/Q4_1 as MLX affine group-32,
floats in float32), plus a Hugging Face tokenizer made from the GGUF's own vocabulary, so that both
servers turn the same request into the same token ids:

- `tokenizer.json`: the `tokenizers.Tokenizer` that `mlxinfer.tokenizer` builds from the GGUF (byte-level
  BPE, llama.cpp's pre-tokenizer splits, CONTROL tokens special, USER_DEFINED tokens added), saved as is;
  a BOS post-processor only where the GGUF asks for BOS (`tokenizer.ggml.add_bos_token`).
- `tokenizer_config.json`: `tokenizer_class` PreTrainedTokenizerFast (the generic class: tokenizer.json
  used as written, whatever the architecture; Qwen2Tokenizer gave the same ids here), BOS/EOS tokens, and
  the GGUF's `tokenizer.chat_template` (a minimal ChatML template where the file has none).
- `generation_config.json`: `eos_token_id` = every end-of-generation id our engine stops at (EOS, EOT and
  the ChatML/Llama end tokens), which mlx-lm reads as its stop set.

Unless `--no-check`, the script then loads OUT_DIR with mlx-lm's own tokenizer loader and checks, on a set
of texts, chat requests and the serving benchmark's prompt, that its ids equal ours (plain text as
`encode_prompt` does it, chat as mlx_lm.server's `apply_chat_template(..., tokenize=True)` against our
`render_chat` + encode), that decoding agrees, and that its stop ids equal ours; it exits 1 otherwise.

`--serve` then runs `mlx_lm.server` in this process (`--model OUT_DIR --host --port`, plus the flags after
`--`; its socket's listen queue raised from 5 to `--backlog` 128, see `serve`) with torch hidden from
transformers (`sys.modules["torch"] = None`: mlx-lm does not use it, and the lent GPU machine's image has
it, which would otherwise make transformers import it), Hugging Face's network use off (HF_HUB_OFFLINE) and
an empty Hugging Face cache (its /v1/models scans the cache, and fails when there is none). /v1/models then
lists OUT_DIR's absolute path; requests may name that or `default_model`.

mlx_lm.server 0.32.2 (its stdlib ThreadingHTTPServer, one generation thread): requests without a draft
model, seed or KV quantization are batched by `BatchGenerator`, continuous batching that decodes up to
`--decode-concurrency` (default 32) sequences together and prefills up to `--prompt-concurrency` (default
8) prompts together in steps of `--prefill-step-size` (default 2048) tokens; an LRU prompt cache
(`--prompt-cache-size`, default 10 entries; `--prompt-cache-bytes`) reuses the KV of the longest cached
prefix, so the benchmark's repeated prompt is prefilled once (as our paged cache's prefix reuse does).
`--prompt-cache-size 0` effectively turns that reuse off. Default `--max-tokens` 512 (requests set theirs).

The carry folder for a machine without a package registry (`.peerwheels/`, git-ignored) holds everything
both servers and the bench import beyond numpy and what `.mlxcuda2` installs (mlx, mlx-lm, gguf): it is
made with `pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform
manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 mlx-lm==0.32.2
tokenizers jinja2 threadpoolctl gguf fastapi uvicorn sse-starlette prometheus-client openai httpx`, less
numpy, mlx-lm, gguf and what neither server imports (hf-xet, sentencepiece, protobuf, typer and its rich,
pygments, markdown-it-py, mdurl, shellingham), the wheels unpacked into one tree and packed as
`site.tar.xz` (12 MB instead of 28 MB of wheels); `.peerwheels/install.sh` unpacks it into /tmp/site.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from serve_bench import bench_prompt

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(gguf_path, out_dir) -> dict:
    """tokenizer.json, tokenizer_config.json and generation_config.json for `gguf_path`'s vocabulary;
    returns a summary (vocabulary size, BOS/EOS, stop ids, where the chat template came from)."""
    from tokenizers import processors

    from mlxinfer.gguf_file import GGUFFile
    from mlxinfer.tokenizer import GGUFTokenizer

    with GGUFFile(gguf_path) as g:
        tok = GGUFTokenizer.from_metadata(g.metadata, source=str(gguf_path))
        context = g.metadata.get(f"{g.architecture}.context_length")
    hf = tok.hf
    hf.encode_special_tokens = False  # control tokens written in text are parsed (chat templates need it)
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else None
    eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else None
    if tok.add_bos:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.bos_id)])
    os.makedirs(out_dir, exist_ok=True)
    hf.save(os.path.join(out_dir, "tokenizer.json"))
    template = tok.chat_template or CHATML_TEMPLATE
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": tok.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context) if context else 32768,
        "chat_template": template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    eog = sorted(int(i) for i in tok.eog_ids)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eog, **({"bos_token_id": tok.bos_id} if tok.bos_id is not None else {})}, f)
    return dict(vocab=tok.vocab_size, pre=tok.pre, bos=bos, eos=eos, add_bos=tok.add_bos, stop_ids=eog,
                chat_template="gguf" if tok.chat_template else "chatml (the GGUF has none)")


def write_peer_model(gguf_path, out_dir) -> dict:
    """The mlx-lm model directory for `gguf_path`: weights (mlxinfer.peers.write_mlx_lm_model, float32)
    and tokenizer."""
    from mlxinfer.peers import write_mlx_lm_model

    write_mlx_lm_model(gguf_path, out_dir)
    return write_tokenizer(gguf_path, out_dir)


def check_token_ids(gguf_path, out_dir, extra_texts=()) -> list[str]:
    """Differences between our tokenization of `gguf_path` and mlx-lm's of `out_dir` (empty: none):
    plain text (ours: `encode_prompt`'s add_special + parse_special; mlx-lm: `tokenizer.encode`, as
    mlx_lm.server does for /v1/completions), chat messages (ours: `render_chat` + encode as
    `Engine._encode_messages`; mlx-lm: `apply_chat_template(tokenize=True)`, as its server does), decoding,
    and the stop ids."""
    from pathlib import Path

    from mlx_lm.utils import load_config, load_tokenizer

    from mlxinfer.chat import render_chat
    from mlxinfer.tokenizer import load_tokenizer as load_ours

    ours = load_ours(gguf_path)
    theirs = load_tokenizer(Path(out_dir), eos_token_ids=load_config(Path(out_dir)).get("eos_token_id"))
    texts = [
        bench_prompt(), "Hello world", "The capital of France is", " leading space", "trailing space ",
        "I'm sure they'll say we'd've DON'T", "numbers 1234567 3.14159 and 2026-11-30",
        "  multiple   spaces\n\n\ttabs\r\nand lines\n", "café naïve Ünïcödé 日本語の文章 한국어 🙂🚀",
        "code: def f(x):\n    return x**2  # comment", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "text with <|im_end|> inside", "<|endoftext|>",
    ]
    texts += [t for t in ours.tokens[-8:] if t.startswith("<|")]  # control / added tokens written in text
    texts += list(extra_texts)
    problems = []
    for t in texts:
        a = ours.encode(t, add_special=True, parse_special=True)
        b = theirs.encode(t)
        if a != b:
            problems.append(f"text {t[:40]!r}: ours {a[:12]}... ({len(a)}) vs mlx-lm {b[:12]}... ({len(b)})")
            continue
        da, db = ours.decode(a), theirs.decode(b)
        if da != db:
            problems.append(f"decode of {t[:40]!r}: ours {da[:40]!r} vs mlx-lm {db[:40]!r}")
    template = ours.chat_template or CHATML_TEMPLATE
    bos = ours.tokens[ours.bos_id] if ours.bos_id is not None else ""
    eos = ours.tokens[ours.eos_id] if ours.eos_id is not None else ""
    chats = [
        [{"role": "user", "content": bench_prompt()}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3? ünï 日本"}],
    ]
    for msgs in chats:
        text = render_chat(template, msgs, bos_token=bos, eos_token=eos, add_generation_prompt=True)
        a = ours.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)
        b = theirs.apply_chat_template(msgs, add_generation_prompt=True, tools=None, tokenize=True)
        b = list(b["input_ids"]) if isinstance(b, dict) or hasattr(b, "keys") else list(b)
        if a != b:
            problems.append(f"chat {msgs[-1]['content'][:30]!r}: ours {a[:12]}... ({len(a)}) vs mlx-lm "
                            f"{b[:12]}... ({len(b)})")
    if set(theirs.eos_token_ids) != set(ours.eog_ids):
        problems.append(f"stop ids: ours {sorted(ours.eog_ids)} vs mlx-lm {sorted(theirs.eos_token_ids)}")
    if len(theirs._tokenizer) != ours.vocab_size:
        problems.append(f"vocabulary: ours {ours.vocab_size} tokens vs mlx-lm {len(theirs._tokenizer)}")
    n_prompt = len(render_chat(template, chats[0], bos_token=bos, eos_token=eos))
    print(f"token ids: {len(texts)} texts and {len(chats)} chats compared; the bench's chat prompt renders to "
          f"{n_prompt} characters, {len(ours.encode(render_chat(template, chats[0]), parse_special=True))} "
          f"tokens; stop ids {sorted(ours.eog_ids)}; {'OK' if not problems else f'{len(problems)} DIFFERENCES'}",
          file=sys.stderr)
    return problems


def hide_torch() -> None:
    """Make transformers see no torch (its find_spec("torch") returns None for a None module entry), as on a
    machine without it: mlx-lm never uses torch, and importing it would only slow the start."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None


def serve(out_dir, host: str, port: int, extra, backlog: int = 128) -> None:
    """Run mlx_lm.server on `out_dir` in this process (see the module docstring); returns when it stops.

    `backlog`: its listening socket's queue of not yet accepted connections. mlx_lm.server is the standard
    library's ThreadingHTTPServer, whose queue holds 5: 32 clients connecting at once then get some of their
    connections reset (openai.APIConnectionError from httpcore's ReadError, seen with serve_bench at
    concurrency 32 in 3 runs of 3; none in 3 runs with 128). uvicorn's (ours) holds 2048."""
    import http.server

    http.server.ThreadingHTTPServer.request_queue_size = backlog
    hide_torch()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if "HF_HUB_CACHE" not in os.environ and "HF_HOME" not in os.environ:
        os.environ["HF_HOME"] = os.path.join(os.path.abspath(out_dir), ".hf_home")
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ["HF_HOME"], "hub")
    os.makedirs(cache, exist_ok=True)
    from mlx_lm import server

    sys.argv = ["mlx_lm.server", "--model", os.path.realpath(out_dir), "--host", host, "--port", str(port), *extra]
    print(f"mlx_lm.server: {' '.join(sys.argv[1:])}", file=sys.stderr, flush=True)
    server.main()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Flags after -- go to mlx_lm.server (e.g. --decode-concurrency 32 "
                                       "--prompt-concurrency 8 --prompt-cache-size 0 --log-level WARNING).")
    p.add_argument("gguf", help="our GGUF model")
    p.add_argument("out_dir", help="the mlx-lm model directory to write (and serve)")
    p.add_argument("--no-write", action="store_true", help="use OUT_DIR as already written")
    p.add_argument("--no-check", action="store_true", help="skip the token-id comparison")
    p.add_argument("--serve", action="store_true", help="then run mlx_lm.server on OUT_DIR")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8792)
    p.add_argument("--backlog", type=int, default=128,
                   help="listen queue of mlx_lm.server's socket (the standard library's default, 5, resets "
                        "connections when 32 clients connect at once; default: %(default)s)")
    args = p.parse_args(argv)
    import time

    hide_torch()

    if not args.no_write:
        t0 = time.perf_counter()
        summary = write_peer_model(args.gguf, args.out_dir)
        print(f"wrote {args.out_dir} in {time.perf_counter() - t0:.1f} s: {json.dumps(summary)}", file=sys.stderr)
    if not args.no_check:
        t0 = time.perf_counter()
        problems = check_token_ids(args.gguf, args.out_dir)
        for line in problems:
            print("  " + line, file=sys.stderr)
        print(f"check took {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        if problems:
            return 1
    if args.serve:
        serve(args.out_dir, args.host, args.port, extra, backlog=args.backlog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
