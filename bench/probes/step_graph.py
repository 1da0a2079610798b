"""What one decode token asks MLX to evaluate, ours beside mlx-lm's (issue 10, target 1's profile).

Decode of a 0.6B model on an H200 is host-bound (bench/probes/step_profile.py): the host's time goes into
evaluating the token's graph, primitive by primitive (each one's eval_gpu; each kernel launch one node of
a CUDA graph). This script takes the graph that each engine hands to `mx.async_eval` for one decode token
(ours: `Backend.start` of a decode pass, the compiled step's tape plus the sampling; mlx-lm: the
`mx.async_eval` in `generate_step`), writes it with `mx.export_to_dot` and counts its primitives by name.
View primitives (reshape, slice, transpose, ...) launch no kernel when their input is contiguous; the
rest launch one (or a few) each. Counts, not times: what a token costs the host is bench/probes/step_profile.py's.

    python3 bench/probes/step_graph.py --cases 17 --out graph.jsonl          # on the GPU (CUDA or Metal)
    python3 bench/probes/step_graph.py --device cpu                          # tries the script here (CPU: no
                                                                      # fast kernels, so other primitives)
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile

import mlx.core as mx

import mlxinfer
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids, write_mlx_lm_model

from jsonl import emit

VIEWS = {"Reshape", "Slice", "Squeeze", "ExpandDims", "Broadcast", "Transpose", "AsStrided", "Split",
         "StopGradient", "Depends", "Flatten", "Unflatten"}


def count(arrays) -> dict:
    """Primitives of the (unevaluated) graph that ends in `arrays`, by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        names = re.findall(r'label ="([^"]+)", shape=rectangle', f.read())
    return dict(collections.Counter(names).most_common())


def row(engine, n, counts) -> dict:
    launches = {k: v for k, v in counts.items() if k not in VIEWS}
    return dict(engine=engine, prompt=n, primitives=sum(counts.values()), launching=sum(launches.values()),
                custom_kernels=sum(v for k, v in counts.items() if "Custom" in k), by_name=counts)


def graph_ours(path, n, device):
    from mlxinfer.backends.mlx import MLXBackend

    engine = mlxinfer.Engine(path, MLXBackend(device=device))
    ops, graphs = engine.backend, []
    start = ops.start

    def capture(*xs):
        graphs.append(count(xs))
        start(*xs)

    ops.start = capture
    engine.generate(prompt_ids(n, engine.args.vocab_size), max_tokens=4)
    return row("mlxinfer", n, graphs[2])  # the prompt's pass, the first decode step, then a step as it repeats


def graph_mlx_lm(path, n):
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_model(__import__("pathlib").Path(write_mlx_lm_model(path, tmp)))
    graphs, async_eval = [], mx.async_eval

    def capture(*xs):
        graphs.append(count(xs))
        async_eval(*xs)

    mx.async_eval = capture
    try:
        for _ in generate_step(mx.array(prompt_ids(n, model.args.vocab_size)), model, max_tokens=4):
            pass
    finally:
        mx.async_eval = async_eval
    return row(f"mlx-lm {mlx_lm.__version__}", n, graphs[2])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="17")
    p.add_argument("--engines", default="ours,mlx-lm")
    p.add_argument("--model", default="qwen3-0.6b-synthetic", help="as mlxinfer bench's --model")
    p.add_argument("--device", default="gpu", help="gpu, or cpu to try the script without one")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    path = model_path(a.model)
    for n in [int(x) for x in a.cases.split(",")]:
        for engine in a.engines.split(","):
            emit(graph_ours(path, n, a.device) if engine == "ours" else graph_mlx_lm(path, n), a.out)


if __name__ == "__main__":
    main()
