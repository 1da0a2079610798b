"""Which attention launch plan is faster on a CUDA GPU, for prefill and for decode (issue 10)? For each
prompt, in one process, one engine: the one-launch kernel for every pass, the split kernels for every
pass, the default rule (`kernels.uses_split`), and the default rule with attention replaced by a copy
of the queries (`no-attention`: an ablation, wrong text, what the rest of a pass costs; left out of
same_tokens; a second engine with its own backend, bench/probes/ablations.py, so its peak memory holds both
engines' weights); each after a warm-up, its compiled decode steps
made afresh (the plan is chosen when a step is traced). Reports time to first token (median of
--runs) and decode tokens/s over --tokens greedy tokens (median), and checks that every plan generates
the same tokens (the bits themselves are tests/test_mlx_backend.py's).

    python3 bench/probes/attention_plans.py --cases 17,511,2047,8191 [--plans auto,no-attention] [--model qwen3-0.6b-synthetic|smollm2|PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import mlx.core as mx

import mlxinfer
from mlxinfer import kernels
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids

from jsonl import emit

AUTO = dict(SPLIT_MAX_ITEMS=kernels.SPLIT_MAX_ITEMS, SPLIT_MAX_SCRATCH=kernels.SPLIT_MAX_SCRATCH)
PLANS = {"one-launch": dict(AUTO, SPLIT_MAX_ITEMS=0, SPLIT_MAX_SCRATCH=0),
         "split": dict(AUTO, SPLIT_MAX_ITEMS=10**9, SPLIT_MAX_SCRATCH=10**18),
         "auto": AUTO,
         "no-attention": AUTO}  # the ablation: fused_attention returns q + 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b-synthetic", help="as mlxinfer bench's --model")
    p.add_argument("--cases", default="17,511,2047,8191")
    p.add_argument("--plans", default=",".join(PLANS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    path = model_path(a.model)
    engine = mlxinfer.load(path, backend="mlx")
    engine.tokenizer = dataclasses.replace(engine.tokenizer, eog_ids=frozenset())  # always --tokens tokens
    ablated = None  # the no-attention plan's engine: its own backend (bench/probes/ablations.py), made when asked
    for n in (int(x) for x in a.cases.split(",")):
        ids = prompt_ids(n, engine.args.vocab_size)
        row, tokens = {"prompt": n, "kernel": engine.backend.kernel, "tokens": a.tokens}, {}
        for plan in a.plans.split(","):
            for name, value in PLANS[plan].items():
                setattr(kernels, name, value)
            engine.decode_step.steps.clear()  # compiled steps chose their plan when traced
            eng = engine
            if plan == "no-attention":
                if ablated is None:
                    from ablations import NoAttention

                    ablated = mlxinfer.Engine(path, NoAttention())
                    ablated.tokenizer = engine.tokenizer
                eng = ablated
                eng.decode_step.steps.clear()
            mx.reset_peak_memory()
            tokens[plan] = eng.generate(ids, max_tokens=a.tokens, temperature=0).token_ids  # + warm-up
            gens = [eng.generate(ids, max_tokens=a.tokens, temperature=0) for _ in range(a.runs)]
            if plan == "no-attention":
                tokens.pop(plan, None)  # wrong text by design: not compared
            row[f"{plan}_ttft_ms"] = round(statistics.median(g.metrics.time_to_first_token_ms for g in gens), 1)
            row[f"{plan}_decode_tok_s"] = round(statistics.median(g.metrics.decode_tokens_per_second for g in gens), 1)
            row[f"{plan}_peak_mib"] = round(mx.get_peak_memory() / 2**20)
        for name, value in AUTO.items():
            setattr(kernels, name, value)
        row["same_tokens"] = len({tuple(t) for t in tokens.values()}) == 1 if len(tokens) > 1 else None
        emit(row, a.out)


if __name__ == "__main__":
    main()
