"""One rank of a tensor-parallel test run, started by tests/test_tp.py under `mlx.launch`:

    mlx.launch -n 2 --backend ring -- python -m tests.tp_worker CASES.json OUT_DIR

For each case (model, backend, prompt ids, tokens to generate) every rank loads its shard with the fused
and the per-head attention path, computes the logits of every prompt position and a greedy continuation,
and writes them to OUT_DIR/case{i}.rank{r}.npz, with whether the two paths' logits are bitwise equal.
"""

import json
import os
import sys

import numpy as np

import mlxinfer


def main(cases_path, out_dir):
    with open(cases_path) as f:
        cases = json.load(f)
    for i, case in enumerate(cases):
        tp = case.get("tp", 2)
        out = {}
        for attention in ("fused", "per-head"):
            engine = mlxinfer.load(case["model"], backend=case["backend"], attention=attention, tp=tp,
                                   prefill_chunk=case.get("prefill_chunk"), dtype=case.get("dtype"))
            key = attention.replace("-", "_")
            out[f"logits_{key}"] = engine.logits(case["prompt"])
            gen = engine.generate(case["prompt"], max_tokens=case["n"], temperature=case.get("temperature", 0.0),
                                  seed=case.get("seed"))
            out[f"tokens_{key}"] = np.array(gen.token_ids, dtype=np.int64)
            out[f"seed_{key}"] = np.array(-1 if gen.seed is None else gen.seed, dtype=np.int64)
        out["fused_equals_per_head"] = np.array(np.array_equal(out["logits_fused"], out["logits_per_head"]))
        out["kv_width"] = np.array(engine.kv_width)
        out["threads"] = np.array(engine.backend.threads)  # the ranks share the machine's cores
        rank = engine.shard.rank
        np.savez(os.path.join(out_dir, f"case{i}.rank{rank}.npz"), **out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
