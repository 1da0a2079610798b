"""Command line: `mlxinfer generate ...` and `mlxinfer inspect FILE`.

The generated text goes to stdout as it is produced; the metrics block (and a trace, with --trace) to
stderr, so `mlxinfer generate ... > out.txt` captures only the text."""

from __future__ import annotations

import argparse
import os
import sys

from .errors import MlxinferError


def _generate(args) -> int:
    from .generate import load

    engine = load(args.model, backend=args.backend, attention=args.attention, device=args.device,
                  kernel=args.kernel, kv=args.kv, prefill_chunk=args.prefill_chunk)
    prompt = args.prompt
    if isinstance(prompt, str) and any(0xDC80 <= ord(c) <= 0xDCFF for c in prompt):
        # argv bytes that were not UTF-8 arrive as surrogate escapes
        prompt = os.fsencode(prompt)
    tracer = None
    if args.trace or os.environ.get("MLXINFER_TRACE") == "1":
        from .tracing import install_tracer

        tracer = install_tracer(engine)

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        chat=args.chat,
        on_text=write,
        on_forward=tracer.end_pass if tracer else None,
    )
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        sys.stderr.write("\n" + result.metrics.format() + "\n")
    if tracer:
        tracer.print_summary()
    return 0


def _inspect(args) -> int:
    from .inspect import describe

    sys.stdout.write(describe(args.file))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 1, like every other bad input
        self.exit(1, f"mlxinfer: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mlxinfer", description="Generate text from GGUF models with MLX or numpy.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a continuation of PROMPT",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("--model", default=None,
                   help="local GGUF path or org/repo/file.gguf (default: SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--backend", default="auto", choices=["auto", "cpu", "mlx"],
                   help="auto: MLX where it has a GPU, else the numpy reference")
    g.add_argument("--attention", default="fused", choices=["fused", "per-head"])
    g.add_argument("--device", default=None, choices=["cpu", "gpu"], help="MLX device (default: gpu if available)")
    g.add_argument("--kernel", default=None, choices=["graph", "metal", "cuda"],
                   help="MLX fused attention implementation (default: metal/cuda on a GPU, graph on the CPU)")
    g.add_argument("--kv", default="prealloc", choices=["prealloc", "basic"],
                   help="KV cache: preallocated and written in place, or grown by concatenation")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill pass (default: 512)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (negative or absent: random)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when TEXT is generated (repeatable; not included in the output)")
    g.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    g.add_argument("--trace", action="store_true", help="count and time every backend op (stderr)")
    g.add_argument("--quiet", action="store_true", help="print only the text, no metrics block")
    g.set_defaults(func=_generate)
    i = sub.add_parser("inspect", help="print a GGUF file's architecture, hyperparameters, tokenizer and tensors")
    i.add_argument("file")
    i.set_defaults(func=_inspect)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MlxinferError as e:
        sys.stdout.flush()
        print(f"mlxinfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mlxinfer: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("mlxinfer: error: out of memory", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
