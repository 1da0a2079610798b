"""What one decode token (or a prompt's first pass) asks MLX to evaluate, ours beside mlx-lm's (issue 10,
target 1's profile; issue 30's launch counts per dtype).

Decode of a 0.6B model on an H200 is host-bound (bench/probes/step_profile.py): the host's time goes into
evaluating the token's graph, primitive by primitive (each one's eval_gpu; each kernel launch one node of
a CUDA graph). This script takes the graph that each engine hands to `mx.async_eval` for one decode token
(ours: `Backend.start` of a decode pass, the compiled step's tape plus the sampling; mlx-lm: the
`mx.async_eval` in `generate_step`), or with `--pass prefill` the prompt's pass (ours: the pass of the whole
prompt with the KV stores it writes; mlx-lm: the prompt less its last token into the cache, then the last
token's step, as `generate_step` runs them), writes it with `mx.export_to_dot` and counts its primitives by
name. View primitives (reshape, slice, transpose, ...) launch no kernel when their input is contiguous; the
rest launch one (or a few) each. Counts, not times: what a token costs the host is bench/probes/step_profile.py's.

`--host` counts the CUDA path's graph on a machine without a GPU: MLX made to report a CUDA GPU
(tests/cuda_host.pretend_gpu), the graph built on the CPU stream and never evaluated past what the run
needs, each `mx.fast` op (whose CPU form is its fallback's several primitives) replaced by one distinctive
primitive (Erf: rms_norm, Expm1: rope, Log1p: scaled_dot_product_attention) and each custom kernel by an
ArcTanh of zeros tied to its inputs (its other outputs: zeros, a Full that is not counted as a launch).
The compiled decode step then fuses stand-ins that the GPU runs as separate kernels (`CompiledErfExpm1`:
an RMSNorm and a RoPE; an ArcTanh inside a Compiled name is a custom kernel besides): `launches_on_gpu`
counts those names as their parts.

    python3 bench/probes/step_graph.py --cases 17 --out graph.jsonl          # on the GPU (CUDA or Metal)
    python3 bench/probes/step_graph.py --host --dtypes float32,bfloat16      # the CUDA path, counted here
    python3 bench/probes/step_graph.py --host --pass prefill --cases 511 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import tempfile

import mlx.core as mx

import mlxinfer
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids, write_mlx_lm_model
from mlxinfer.sampling import SamplingParams

from jsonl import emit

VIEWS = {"Reshape", "Slice", "Squeeze", "ExpandDims", "Broadcast", "Transpose", "AsStrided", "Split",
         "StopGradient", "Depends", "Flatten", "Unflatten", "View"}


def count(arrays) -> dict:
    """Primitives of the (unevaluated) graph that ends in `arrays`, by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        names = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    return dict(collections.Counter(n.split(" ")[0] for n in names).most_common())


STANDINS = ("ArcTanh", "Erf", "Expm1", "Log1p")  # --host: each one kernel of its own on a GPU


def gpu_launches(name: str) -> int:
    """--host: the kernels a node of the stand-in graph is on a GPU: a Compiled node fused around stand-ins
    is each stand-in plus one for the rest of its elementwise chain, if any."""
    if not name.startswith("Compiled"):
        return 1
    rest = name[len("Compiled"):]
    found = 0
    for s in STANDINS:
        found += rest.count(s)
        rest = rest.replace(s, "")
    return found + bool(re.sub(r"Broadcast", "", rest))


def row(engine, n, counts, **extra) -> dict:
    launches = {k: v for k, v in counts.items() if k not in VIEWS and not (CUSTOM and k == "Full")}
    more = dict(launches_on_gpu=sum(v * gpu_launches(k) for k, v in launches.items())) if CUSTOM else {}
    return dict(engine=engine, prompt=n, primitives=sum(counts.values()), launching=sum(launches.values()), **more,
                custom_kernels=sum(v for k, v in counts.items() if "Custom" in k), by_name=counts, **extra)


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


CUSTOM = collections.Counter()  # --host: the custom kernels a graph would launch, by name


def host_standins():
    """--host: the CUDA path without a GPU (see the docstring)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
    import cuda_host

    from mlxinfer import cuda_jit

    mx.fast.rms_norm = lambda x, weight, eps: mx.erf(x)
    mx.fast.rope = lambda x, dims, **kw: mx.expm1(x)
    mx.fast.scaled_dot_product_attention = lambda q, k, v, **kw: mx.depends([mx.log1p(q)], [k, v])[0]

    def kernel(self, *, inputs, output_shapes, output_dtypes, **kw):
        CUSTOM[self.name] += 1
        zeros = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        first = mx.arctanh(mx.depends(zeros[:1], [a for a in inputs if isinstance(a, mx.array)])[0])
        return [first] + mx.depends(zeros[1:], [first]) if len(zeros) > 1 else [first]

    cuda_jit.Kernel.__call__ = kernel
    return cuda_host.pretend_gpu(_Patch(), "cuda")


def graph_ours(path, n, device, dtype, phase, kernel=None, batch=1):
    from mlxinfer.backends.mlx import MLXBackend

    ops = MLXBackend(device=device, dtype=dtype, kernel=kernel)
    if kernel:  # --host: no self-check, and the model's chunks as a GPU that passed it takes them
        ops.check_model = lambda *a, **k: None
    engine = mlxinfer.Engine(path, ops)
    graphs, start, loop = [], ops.start, None

    def capture(*xs):  # (counted before evaluation: an evaluated array has no graph)
        stores = [a for a in loop.cache.arrays() if a is not None] if phase == "prefill" else []
        graphs.append(count(list(xs) + stores))
        if phase != "prefill":  # (the prompt's pass is counted, not run)
            start(*xs)

    ops.start = capture
    CUSTOM.clear()
    if phase == "prefill":
        loop = engine.new_loop()
        for b in range(batch):  # (batch B: B prompts of n tokens, row b's seeded b, in one pass where they fit)
            loop.admit(prompt_ids(n, engine.args.vocab_size, seed=b), SamplingParams(), max_tokens=4)
        loop.step()
        counts = graphs[0]  # the prompt's pass, with the KV stores it writes
    else:
        engine.generate(prompt_ids(n, engine.args.vocab_size), max_tokens=4)
        counts = graphs[2]  # the prompt's pass, the first decode step, then a step as it repeats
    extra = dict(dtype=dtype, phase=phase, custom_kernel_calls=dict(CUSTOM)) if kernel else dict(dtype=dtype, phase=phase)
    return row("mlxinfer", n, counts, **extra)


def graph_mlx_lm(path, n, dtype, phase):
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_model(pathlib.Path(write_mlx_lm_model(path, tmp, dtype=dtype)))
    ids = mx.array(prompt_ids(n, model.args.vocab_size))
    name = f"mlx-lm {mlx_lm.__version__}"
    if phase == "prefill":
        cache = make_prompt_cache(model)
        model(ids[None, :-1], cache=cache)
        logits = model(ids[None, -1:], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        states = [a for c in cache for a in c.state if isinstance(a, mx.array)]
        return row(name, n, count([mx.argmax(logprobs, axis=-1), logprobs] + states), dtype=dtype, phase=phase)
    graphs, async_eval = [], mx.async_eval

    def capture(*xs):
        graphs.append(count(xs))
        async_eval(*xs)

    mx.async_eval = capture
    try:
        for _ in generate_step(ids, model, max_tokens=4):
            pass
    finally:
        mx.async_eval = async_eval
    return row(name, n, graphs[2], dtype=dtype, phase=phase)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="17")
    p.add_argument("--engines", default="ours,mlx-lm")
    p.add_argument("--model", default="qwen3-0.6b-synthetic", help="as mlxinfer bench's --model")
    p.add_argument("--device", default="gpu", help="gpu, or cpu to try the script without one")
    p.add_argument("--dtypes", default="float32", help="the activations' dtypes (ours --dtype; mlx-lm's weights)")
    p.add_argument("--pass", dest="phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--host", action="store_true", help="count the CUDA path's graph here, without a GPU")
    p.add_argument("--batch", type=int, default=1, help="ours, --pass prefill: B prompts of each length in one pass")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    kernel = host_standins() if a.host else None
    mx.set_default_device(mx.gpu if a.device == "gpu" and not a.host else mx.cpu)
    path = model_path(a.model)
    for n in [int(x) for x in a.cases.split(",")]:
        for dtype in a.dtypes.split(","):
            for engine in a.engines.split(","):
                if engine == "ours":
                    emit(graph_ours(path, n, "gpu" if a.host else a.device, dtype, a.phase, kernel, a.batch), a.out)
                else:
                    emit(graph_mlx_lm(path, n, dtype, a.phase), a.out)


if __name__ == "__main__":
    main()
