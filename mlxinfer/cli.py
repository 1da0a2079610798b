"""Command line: `mlxinfer generate ...`, `mlxinfer chat ...`, `mlxinfer serve ...`, `mlxinfer perplexity
MODEL --text FILE` and `mlxinfer inspect FILE`.

`generate` writes the generated text to stdout as it is produced, and the metrics block (and a trace,
with --trace) to stderr, so `mlxinfer generate ... > out.txt` captures only the text; the prompt goes
through the file's chat template where it has one (--raw: as it is). `chat` is an interactive
conversation in the terminal with the model's chat template, its turns over one KV cache."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

from . import __version__, benchmark
from .backend import DTYPES, GPU_DEFAULT_DTYPES, KV_DTYPES
from .backends.cpu import checked_threads, default_threads
from .collectives import launched
from .engine import DEFAULT_PREFILL_CHUNK, load
from .errors import MlxinferError, RequestError
from .inspect import describe, kernels_report
from .launch import check_split, record_status, relaunch
from .loop import FinishEvent
from .model_source import resolve_model
from .perplexity import check_options as check_perplexity_options, perplexity
from .sampling import SamplingParams, stop_strings
from .scheduler import budget_blocks
from .server import Bounds, is_loopback, require_extra, serve
from .tracing import install_tracer


class _OutputError(MlxinferError):
    """Writing the generated text to stdout failed (a full disk, an I/O error; not a closed pipe)."""


_line_open = False  # the text on stdout ends inside a line (a message on stderr starts a new one first)


def _out(text: str) -> None:
    """Write to stdout now (the text appears as it is generated)."""
    global _line_open
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        if text:
            _line_open = not text.endswith("\n")
    except BrokenPipeError:
        raise
    except OSError as e:
        raise _OutputError(f"writing the output: {e.strerror or e}") from None


def _new_line() -> None:
    """End the text's open line on stderr before a message (a trace, Ctrl-C, an error) is written there:
    on a terminal both streams share the screen, and the message would follow the text on its line."""
    global _line_open
    if _line_open:
        _line_open = False
        sys.stderr.write("\n")


class _Messages:
    """stderr for messages written while the text streams (the tracer's per-pass histograms)."""

    def write(self, text: str) -> None:
        _new_line()
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _load(args):
    ranks = getattr(args, "tp", 1)
    free = default_threads(ranks)
    if args.threads is not None and checked_threads(args.threads) > free:  # as llama.cpp does not, and should
        print(f"mlxinfer: warning: --threads {args.threads} is more than the {free} cores free for it (of "
              f"{os.cpu_count()}, by the load average): threads that wait for busy cores can slow it many "
              "times over", file=sys.stderr)
    chunk = args.prefill_chunk
    if chunk is None and args.command == "serve":  # running streams wait for a pass at most 512 rows long, and
        chunk = DEFAULT_PREFILL_CHUNK              # a GPU reuses a shared prefix in whole chunks (Loop._reusable)
    return load(args.model, backend=args.backend, attention=args.attention, device=args.device,
                kernel=args.kernel, kv=args.kv, prefill_chunk=chunk, threads=args.threads,
                tp=getattr(args, "tp", 1), dtype=args.dtype, kv_dtype=args.kv_dtype, **prompt_cache_options(args))


def prompt_cache_options(args) -> dict:
    """load()'s prompt cache options where the command has them (serve)."""
    if getattr(args, "prompt_cache_dir", None) is None:
        if getattr(args, "prompt_cache_size", None) is not None:
            raise RequestError("--prompt-cache-size needs --prompt-cache-dir")
        return {}
    size = args.prompt_cache_size
    if size is not None and size < 1:
        raise RequestError(f"--prompt-cache-size must be a positive number of bytes, got {size}")
    return dict(prompt_cache_dir=args.prompt_cache_dir, **({} if size is None else dict(prompt_cache_size=size)))


def _sampling(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                stop=args.stop, repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty)


def _constraint(args) -> dict:
    """generate's structured output options as `Engine.generate` takes them (mlxinfer.grammar)."""
    def read(path, what):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"{path}: cannot read the {what} ({getattr(e, 'strerror', None) or e})") from None
    given = [o for o, v in (("--json-schema", args.json_schema), ("--json", args.json or None),
                            ("--grammar", args.grammar), ("--regex", args.regex)) if v is not None]
    if len(given) > 1:
        raise RequestError(f"one of {given[0]} and {given[1]}, not both")
    if args.json_schema is not None:
        schema = read(args.json_schema, "JSON schema")
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}}
    if args.json:
        return {"response_format": {"type": "json_object"}}
    if args.grammar is not None:
        return {"grammar": read(args.grammar, "grammar")}
    return {"regex": args.regex} if args.regex is not None else {}


def _argv_escaped(text: str) -> bool:
    """Whether an argument held bytes that were not UTF-8 (Python passes them as surrogate escapes)."""
    return any(0xDC80 <= ord(c) <= 0xDCFF for c in text)


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}


def unescape(text: str) -> str:
    """llama.cpp's escapes in an option's text: \\n, \\t, \\r, \\\\, \\" and \\' (`--stop "\\n"` stops at a
    newline); any other backslash stays as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in ESCAPES:
            out.append(ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _read_prompt(args):
    given = [x for x in (args.prompt, args.prompt_option, args.prompt_file) if x is not None]
    if len(given) > 1:
        raise RequestError("give the prompt once: as PROMPT, -p/--prompt TEXT or --prompt-file FILE")
    if args.prompt_option is not None:
        args.prompt = args.prompt_option
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                return f.read()
        except OSError as e:
            raise RequestError(f"{args.prompt_file}: cannot read the prompt file ({e.strerror})") from None
    if args.prompt is None:
        raise RequestError("no prompt: give PROMPT, -p TEXT, - (read stdin) or --prompt-file FILE")
    if args.prompt == "-":
        if sys.stdin is None:
            raise RequestError("stdin is closed: there is no prompt to read (PROMPT -)")
        return sys.stdin.buffer.read()
    if _argv_escaped(args.prompt):
        return os.fsencode(args.prompt)
    return args.prompt


def _check_options(args) -> None:
    """--max-tokens, the sampling options and --stop, refused before the model loads (chat would
    otherwise refuse them at every turn)."""
    if args.max_tokens < 1:
        raise RequestError(f"--max-tokens must be a positive integer, got {args.max_tokens}")
    SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, args.seed, args.repeat_penalty,
                   args.presence_penalty, args.frequency_penalty)
    for name, text in [("--stop", s) for s in args.stop or []] + [("--system", getattr(args, "system", None))]:
        if text and _argv_escaped(text):
            raise RequestError(f"{name} is not valid UTF-8")
    stop_strings(args.stop)


def _templated(args, engine) -> bool:
    """Whether `generate` wraps the prompt in the chat template: by default where the file has one (as
    mlx-lm's CLI does; an Instruct model given a bare question otherwise answers with an empty line),
    always with --chat/--system (an error without a template), never with --raw."""
    if args.chat or args.system is not None:
        return True
    if args.raw or not engine.tokenizer.chat_template:
        if args.verbose and not args.raw:
            print(f"mlxinfer: {engine.path} has no chat template: the prompt is continued as it is", file=sys.stderr)
        return False
    return True


def _generate(args) -> int:
    if args.tp < 1:
        raise RequestError(f"--tp must be a positive integer, got {args.tp}")
    _check_options(args)
    if args.raw and (args.chat or args.system is not None):
        raise RequestError("--raw continues the prompt as it is: not with --chat or --system")
    if args.tp > 1 and not launched():  # start the ranks under mlx.launch; each runs this same command
        check_split(args.model, args.tp)  # a model that cannot be split is refused here, once
        prompt = _read_prompt(args)  # a prompt from stdin reaches the ranks as a file (their stdin is closed)
        if args.prompt != "-":
            return relaunch(args.tp, args.argv, args.device)
        with tempfile.NamedTemporaryFile(prefix="mlxinfer-prompt-", suffix=".txt") as f:
            f.write(prompt if isinstance(prompt, bytes) else prompt.encode())
            f.flush()
            argv = list(args.argv)
            argv.remove("-")
            return relaunch(args.tp, argv + ["--prompt-file", f.name], args.device)
    prompt = _read_prompt(args)
    constraint = _constraint(args)  # (files read before the model loads)
    engine = _load(args)
    if engine.shard.rank > 0:  # rank 0 prints the text and the metrics; the others print nothing
        sys.stdout = open(os.devnull, "w")
        args.quiet, args.verbose, args.trace = True, False, False
    tracer = None
    if args.trace or (os.environ.get("MLXINFER_TRACE") == "1" and engine.shard.rank == 0):
        tracer = install_tracer(engine, _Messages())
    ids = engine.encode_prompt(prompt, chat=_templated(args, engine),  # once: the cap below and the
                               system=args.system)  # generation read it
    max_tokens = engine.room(len(ids), args.max_tokens)  # the API's rule: capped to the context, said here
    if max_tokens < args.max_tokens:
        print(f"mlxinfer: note: --max-tokens {args.max_tokens} capped to {max_tokens}: the prompt leaves "
              f"{max_tokens} tokens of the model's context length {engine.args.context_length}", file=sys.stderr)
    if args.verbose:
        print(f"mlxinfer: {engine.path}: {engine.args.arch}, {engine.args.n_layers} layers; backend "
              f"{engine.backend.describe()}, attention {engine.backend.attention}, kv {engine.kv}", file=sys.stderr)

    result = engine.generate(ids, max_tokens=max_tokens, on_text=_out,
                             on_forward=tracer.end_pass if tracer else None, **_sampling(args), **constraint)
    _out("\n")
    if not args.quiet:
        sys.stderr.write("\n" + result.metrics.format() + "\n")
    if args.verbose and result.seed is not None:  # (also with --quiet: the seed is what --verbose is asked for)
        sys.stderr.write(f"mlxinfer: seed {result.seed}\n" if args.quiet else f"  seed: {result.seed}\n")
    if tracer:
        tracer.print_summary()
    return 0


CHAT_HELP = """/help    this list
/reset   forget the conversation (and its KV cache)
/exit    leave (also /quit, Ctrl-D)
Ctrl-C   stop a reply (what was said stays in the history); at the prompt: leave
A line starting with / is a command, never sent to the model; // at its start sends one /.
"""


def run_chat(engine, read_line, write, *, system: str | None = None, max_tokens: int = 512, sampling=None) -> None:
    """The chat loop: read a line, stream the reply, keep the history. `read_line(prompt)` returns a
    line or raises EOFError; a line starting with / is a command answered here (/help, /reset, /exit),
    never sent to the model. The turns share one KV cache (`Engine.conversation`): each prefills only
    what it adds to the history. Ctrl-C during a reply stops that reply; at the prompt it leaves."""
    def fresh():
        return [{"role": "system", "content": system}] if system else []

    history = fresh()
    conversation = engine.conversation()
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            command = text.split()[0]
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                history = fresh()
                conversation.reset()
                write("(history cleared)\n")
            elif command == "/help":
                write(CHAT_HELP)
            else:
                write(f"unknown command {command} (/help lists them; // at the start sends a /)\n")
            continue
        if text.startswith("//"):
            text = text[1:]
        history.append({"role": "user", "content": text})
        reply = []
        events = None
        try:
            ids = engine.encode_prompt(history)  # once: the room left and the reply read it
            if len(ids) >= engine.args.context_length:
                raise RequestError("the conversation fills the model's context: /reset to start again")
            room = engine.room(len(ids), max_tokens)
            events = conversation.stream(ids, max_tokens=room, **(sampling or {}))
            for event in events:
                if event.text:
                    write(event.text)
                    reply.append(event.text)  # what the user saw is what the history keeps
                if isinstance(event, FinishEvent) and event.finish_reason == "length" and room < max_tokens:
                    write("\n(the model's context is full: /reset to start again)")
        except KeyboardInterrupt:
            write(" [stopped]")
        except _OutputError:
            raise
        except MlxinferError as e:
            history.pop()
            write(f"mlxinfer: error: {e}\n")
            continue
        finally:
            if events is not None:
                events.close()  # a reply cut short: the conversation's cache starts again
        write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def _chat(args) -> int:
    if sys.stdin is None:
        raise RequestError("chat reads the conversation from stdin, which is closed")
    _check_options(args)
    engine = _load(args)
    if not engine.tokenizer.chat_template:
        raise RequestError(f"{engine.path}: chat needs tokenizer.chat_template, which this file lacks")
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (optional: input() then edits lines and keeps their history)
        except ImportError:
            pass
        print("mlxinfer chat: /help lists the commands, /reset forgets the conversation, /exit leaves; "
              "Ctrl-C stops a reply.", file=sys.stderr)

    def read_line(prompt):
        if interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    run_chat(engine, read_line, _out, system=args.system, max_tokens=args.max_tokens, sampling=_sampling(args))
    return 0


def _check_listen(host: str, port: int) -> None:
    """Whether the server could listen on host:port now (a port in use, an unknown host: one line)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a listener still refuses
            s.bind(addr)
    except OSError as e:
        raise RequestError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _serve(args) -> int:
    require_extra()  # the server's packages are an optional extra: a missing one is named before anything loads
    for name in ("port", "max_batch", "max_queue", "kv_memory"):
        v = getattr(args, name)
        if v is not None and (v < 1 or (name == "port" and v > 65535)):
            raise RequestError(f"--{name.replace('_', '-')} must be a positive integer{' below 65536' if name == 'port' else ''}, got {v}")
    bounds = _bounds(args)
    if args.api_key is not None and not args.api_key.strip():
        raise RequestError("--api-key must not be empty")
    if args.api_key is None and not is_loopback(args.host):
        print(f"mlxinfer: WARNING: listening on {args.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    _check_listen(args.host, args.port)  # before the model loads: a port in use is a one-line error
    engine = _load(args)
    if engine.kv == "paged":
        budget_blocks(engine, args.kv_memory)  # a budget below one block fails here, not in the server's startup
    model_id = args.alias or os.path.basename(engine.path)
    print(f"mlxinfer: serving {model_id} on http://{args.host}:{args.port}/v1 ({engine.backend.describe()}, "
          f"max batch {args.max_batch})", file=sys.stderr)
    serve(engine, model_id, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          kv_memory=args.kv_memory, cors_origins=tuple(args.cors or ()), reasoning=args.reasoning,
          api_key=args.api_key, bounds=bounds)
    return 0


def _bounds(args) -> Bounds:
    """serve's connection bounds, checked (and the open-file limit raised to hold them) before the model loads."""
    if args.max_connections < 1:
        raise RequestError(f"--max-connections must be a positive integer, got {args.max_connections}")
    for name in ("timeout_keep_alive", "timeout_header", "timeout_body", "timeout_send", "drain_timeout"):
        v = getattr(args, name)
        if not (v > 0 or (name == "drain_timeout" and v == 0)) or v == float("inf"):
            raise RequestError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v}")
    bounds = Bounds(args.max_connections, args.timeout_keep_alive, args.timeout_header, args.timeout_body,
                    args.timeout_send, args.drain_timeout)
    bounds.fit_descriptors()
    return bounds


def _perplexity(args) -> int:
    if args.model_arg is not None and args.model is not None:
        raise RequestError("give the model once: as MODEL or -m/--model")
    args.model = args.model_arg if args.model_arg is not None else args.model
    check_perplexity_options(args.ctx, args.batch, float("inf"))  # before the model loads
    try:
        with open(args.text, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RequestError(f"{args.text}: cannot read the text ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{args.text}: not UTF-8 text (byte {e.start})") from None
    engine = _load(args)
    result = perplexity(engine, text, ctx=args.ctx, batch=args.batch, progress=not args.quiet)
    _out(result.format() + "\n")
    return 0


def _inspect(args) -> int:
    if args.kernels:
        line, passed = kernels_report()
        _out(line + "\n")
        return 0 if passed else 1
    _out(describe(resolve_model(args.file)))  # (no FILE: the default model, as the other commands take it)
    return 0


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where the help already says its default or there is none to show."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # no prefix matching: `--prompt x` must not be taken for `--prompt-file x`, nor `--temperature`
        # for `--temp`; an option is named in full (or by its short form)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line and status 1, like every other bad input
        self.exit(1, f"mlxinfer: error: {message} (see {self.prog} --help)\n")


def _model_options(p, sampling: bool = True) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="local GGUF path or org/repo/file.gguf (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "mlx"],
                   help="auto: MLX where it has a GPU, else the numpy reference")
    p.add_argument("--attention", default="fused", choices=["fused", "per-head"])
    p.add_argument("--device", default=None, choices=["cpu", "gpu"], help="MLX device (default: gpu if available)")
    p.add_argument("--kernel", default=None, choices=["graph", "metal", "cuda"],
                   help="MLX fused attention implementation (default: cuda on CUDA, metal after a self-check on "
                        "Metal, graph on the CPU)")
    p.add_argument("--kv", default="paged" if not sampling else "prealloc", choices=["prealloc", "paged", "basic"],
                   help="KV cache: preallocated per sequence and written in place; paged (blocks, prefix reuse); "
                        "or grown by concatenation")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill pass (default: 512; 2048 in bfloat16/float16 on CUDA, except under serve)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="MLX: the activations' and products' dtype (default: float32 on MLX's CPU, "
                        f"{GPU_DEFAULT_DTYPES['cuda']} on CUDA, {GPU_DEFAULT_DTYPES['metal']} on Metal; "
                        "the cpu backend: float32 only)")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help="MLX: what the KV cache stores (default: --dtype); q8_0: int8 in blocks of 32 with a "
                        "float16 scale each, as llama.cpp's -ctk q8_0")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads: the cpu backend's BLAS threads, or the threads MLX's CPU device cuts "
                        "large quantized weight products and attention over (default: the cores not already "
                        "busy, at most cores / N with --tp N; at most 4 per core; not with --device gpu)")
    if not sampling:
        return
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (negative or absent: random)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R",
                   help="divide positive / multiply negative logits of tokens in the prompt or output by R (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="A",
                   help="subtract A from the logits of tokens already generated (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F x count from the logits of tokens generated count times (OpenAI's)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", type=unescape,
                   help="stop when TEXT is generated (repeatable; not included in the output; \\n, \\t, \\r, "
                        "\\\\, \\\" and \\' are escapes, as in llama.cpp)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mlxinfer", description="Generate text from GGUF models with MLX or numpy.")
    p.add_argument("--version", action="version", version=f"mlxinfer {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    fmt = _DefaultsFormatter
    g = sub.add_parser("generate", help="answer PROMPT in the model's chat template (--raw: continue it)", formatter_class=fmt)
    g.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt; - reads it from stdin")
    g.add_argument("-p", "--prompt", dest="prompt_option", default=None, metavar="TEXT",
                   help="the prompt, as an option (as llama.cpp and mlx-lm take it)")
    g.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE")
    _model_options(g)
    g.add_argument("-n", "--max-tokens", type=int, default=64,
                   help="tokens to generate at most (capped by the context)")
    g.add_argument("--chat", action="store_true",
                   help="wrap PROMPT in the model's chat template (the default where the file has one; with "
                        "--chat a file without one is an error)")
    g.add_argument("--raw", "--ignore-chat-template", action="store_true", dest="raw",
                   help="continue PROMPT as it is, without the chat template")
    g.add_argument("--system", default=None, metavar="TEXT", help="a system prompt (implies --chat)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output is JSON following the JSON schema in FILE (structured output)")
    g.add_argument("--json", action="store_true", help="the output is a JSON object")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="the output follows the Lark or GBNF grammar in FILE")
    g.add_argument("--regex", default=None, metavar="REGEX", help="the output matches REGEX")
    g.add_argument("--trace", action="store_true", help="count and time every backend op (stderr)")
    g.add_argument("--quiet", action="store_true", help="print only the text, no metrics block")
    g.add_argument("--verbose", action="store_true", help="also say what was loaded, and the seed")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: split the model over N ranks started with mlx.launch (NCCL "
                        "between CUDA GPUs, ring over TCP otherwise)")
    g.set_defaults(func=_generate)
    c = sub.add_parser("chat", help="talk with the model in the terminal (its chat template)", formatter_class=fmt)
    _model_options(c)
    c.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    c.add_argument("-n", "--max-tokens", type=int, default=512, help="tokens per reply at most")
    c.set_defaults(func=_chat)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching", formatter_class=fmt)
    _model_options(s, sampling=False)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8080, help="TCP port")
    s.add_argument("--max-batch", type=int, default=8, metavar="N", help="requests decoded together at most")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting for the batch at most (beyond: 429 with Retry-After)")
    s.add_argument("--kv-memory", type=int, default=None, metavar="BYTES",
                   help="KV cache budget: requests wait until they fit (default: unbounded)")
    s.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="keep prompts' KV blocks in DIR across restarts (needs --kv paged, the default)")
    s.add_argument("--prompt-cache-size", type=int, default=None, metavar="BYTES",
                   help="the prompt cache directory's bound (least recently used blocks removed first; "
                        "default 4 GiB)")
    s.add_argument("--alias", default=None, metavar="NAME",
                   help="the model id the server reports (default: the file's name); requests may name any model")
    s.add_argument("--cors", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. http://localhost:3000, or *) call the server from a "
                        "browser (repeatable; default: none)")
    s.add_argument("--reasoning", default="auto", choices=["auto", "on", "off"],
                   help="return chat turns' <think>...</think> as reasoning_content (auto: where the vocabulary "
                        "has both tags as tokens)")
    s.add_argument("--api-key", default=os.environ.get("MLXINFER_API_KEY"), metavar="KEY",
                   help="requests to /v1 and /metrics must send 'Authorization: Bearer KEY' (default: "
                        "$MLXINFER_API_KEY; none: anyone who reaches the server is served)")
    limits = Bounds()
    s.add_argument("--max-connections", type=int, default=limits.max_connections, metavar="N",
                   help="open connections at most (at the cap, a new one closes the longest idle)")
    for name, what in (("keep-alive", "a connection idle between requests"),
                       ("header", "a request's headers, from the connection's start or its last response"),
                       ("body", "a request's body, after its headers"),
                       ("send", "a response the client does not read (then the request is cancelled)")):
        s.add_argument(f"--timeout-{name}", type=float, default=getattr(limits, f"timeout_{name.replace('-', '_')}"),
                       metavar="SECONDS", help=f"bound on {what}")
    s.add_argument("--drain-timeout", type=float, default=limits.drain_timeout, metavar="SECONDS",
                   help="on SIGTERM, time for the requests in flight to finish (new ones get 503); 0: stop at once")
    s.set_defaults(func=_serve)
    q = sub.add_parser("perplexity", help="the model's perplexity on a text, by llama-perplexity's method",
                       formatter_class=fmt)
    q.add_argument("model_arg", metavar="MODEL", nargs="?", default=None,
                   help="local GGUF path or org/repo/file.gguf (or -m; default: SmolLM2-135M-Instruct Q4_1)")
    q.add_argument("-f", "--text", required=True, metavar="FILE", help="the text (UTF-8), at least 2 windows long")
    q.add_argument("-c", "--ctx", type=int, default=512, metavar="N",
                   help="tokens per window; the second half of each is scored")
    q.add_argument("-b", "--batch", type=int, default=1, metavar="B", help="windows evaluated together per pass")
    _model_options(q, sampling=False)
    q.set_defaults(kv="prealloc")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=_perplexity)
    i = sub.add_parser("inspect", help="print a GGUF file's architecture, hyperparameters, tokenizer and tensors")
    i.add_argument("file", nargs="?", help="a GGUF file (default: the default model)")
    i.add_argument("--kernels", action="store_true",
                   help="instead: run the GPU kernels' self-check on this machine and print its verdict in one line")
    i.set_defaults(func=_inspect)
    b = sub.add_parser("bench", help="measure time to first token, tokens/s and peak memory (beside mlx-lm, llama.cpp)",
                       formatter_class=fmt)
    benchmark.add_arguments(b)
    b.set_defaults(func=benchmark.run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `mlxinfer` alone: what it can do
        parser.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)
    rc = 1
    try:
        if sys.stdout is None and args.command != "serve":  # started with stdout closed (`>&-`)
            raise RequestError("stdout is closed: nowhere to write the output")
        rc = args.func(args)
        return rc
    except _OutputError as e:  # stdout is unusable: say so, and keep Python's flush at exit from failing again
        _quiet_stdout()
        _say(f"mlxinfer: error: {e}")
        return 1
    except MlxinferError as e:
        if sys.stdout is not None:
            sys.stdout.flush()
        _say(f"mlxinfer: error: {e}")
        return 1
    except KeyboardInterrupt:
        _new_line()
        print("mlxinfer: interrupted", file=sys.stderr)
        rc = 130
        return rc
    except MemoryError:
        print("mlxinfer: error: out of memory", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout went away (`mlxinfer generate ... | head`): stop quietly
        _quiet_stdout()  # and keep Python's flush at exit from failing again on the closed pipe
        rc = 141  # 128 + SIGPIPE, what a shell reports for such a pipeline
        return rc
    finally:
        record_status(rc)  # in a rank of `generate --tp N`: tell the parent how it ended


def _quiet_stdout() -> None:
    """Point stdout's descriptor at /dev/null (after a write to it failed)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass


def _say(line: str) -> None:
    """One line on stderr, if stderr can take it (it may be on the same full disk as stdout)."""
    try:
        _new_line()
        print(line, file=sys.stderr)
    except (AttributeError, OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
