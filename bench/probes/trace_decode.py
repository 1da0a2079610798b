"""Per-pass op histogram of one decode step, per-head vs fused, on each backend (README's table).

    python3 bench/probes/trace_decode.py [--model qwen3-0.6b-synthetic] [--backends cpu,mlx] [--prompt 16] [--kv prealloc]

For each backend and attention path: prefill a prompt, then trace exactly one decode step (the forward
pass of one sequence and the greedy sampling of its token) and print its histogram, then time untraced
decode steps (median of --steps) for the wall time. The passes are driven directly through the model's
forward, `engine.model(ops, ids, batch, cache)`, one sequence in one cache slot, each step read before
the next is built (no pipelining: the wall time is one whole step).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import mlxinfer
from mlxinfer.batch import Batch
from mlxinfer.benchmark import model_path
from mlxinfer.kv_cache import KV_CACHES
from mlxinfer.peers import prompt_ids
from mlxinfer.sampling import Sampler, SamplingParams
from mlxinfer.tracing import TracingBackend

GREEDY = SamplingParams()


class Sequence:
    """One sequence in its own slot of a fresh cache on `ops` (the engine's backend or a tracer)."""

    def __init__(self, engine, ops, n_tokens: int):
        a = engine.args
        self.engine, self.ops = engine, ops
        self.cache = KV_CACHES[engine.kv](ops, a.n_layers, a.n_kv_heads * a.head_dim)
        self.slot = self.cache.alloc()
        self.cache.expect(self.slot, n_tokens)
        self.held = 0

    def step(self, ids: list[int]) -> int:
        """One forward pass over `ids` (prefill: all of them in one pass) and its greedy token."""
        ops = self.ops
        batch = Batch(ops, [self.slot], [self.held], [len(ids)])
        self.cache.reserve(batch)
        logits = self.engine.model(ops, ops.index_array(ids), batch, self.cache)
        tokens, _ = ops.sample_tokens(logits, Sampler([GREEDY], [None]))
        self.held += len(ids)
        return int(ops.to_numpy(tokens)[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b-synthetic",
                   help="qwen3-0.6b-synthetic, smollm2 or a GGUF path (default: %(default)s)")
    p.add_argument("--backends", default="cpu,mlx", help="comma-separated backends (default: %(default)s)")
    p.add_argument("--device", default=None, help="MLX device, cpu or gpu (default: gpu where available)")
    p.add_argument("--kv", default="prealloc", choices=sorted(KV_CACHES), help="KV cache (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=16, help="tokens in the cache before the traced step "
                                                          "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="untraced decode steps timed (default: %(default)s)")
    a = p.parse_args(argv)
    path = model_path(a.model)
    for backend in a.backends.split(","):
        for attention in ("per-head", "fused"):
            engine = mlxinfer.load(path, backend=backend, attention=attention, device=a.device, kv=a.kv)
            ids = prompt_ids(a.prompt, engine.args.vocab_size)
            # untraced decode-step wall time
            seq = Sequence(engine, engine.backend, a.prompt + a.steps + 1)
            tok = seq.step(ids)
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                tok = seq.step([tok])
                times.append((time.perf_counter() - t0) * 1000)
            # one traced decode step after a fresh prefill
            out = io.StringIO()
            tracer = TracingBackend(engine.backend, out)
            seq = Sequence(engine, tracer, a.prompt + 2)
            tok = seq.step(ids)
            tracer.start_pass()  # drop the prefill: trace exactly one decode step
            seq.step([tok])
            tracer.end_pass(f"decode step ({attention}, {a.kv} cache, {a.prompt} cached tokens)")
            print(out.getvalue().rstrip())
            print(f"  untraced decode step wall time: median {statistics.median(times):.2f} ms "
                  f"(min {min(times):.2f}, {a.steps} steps)\n", flush=True)
            del engine


if __name__ == "__main__":
    main()
