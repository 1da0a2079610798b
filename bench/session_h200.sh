#!/bin/bash
# One lent-H200 call of 2026-12-04 (issue 30), kept as run: the tensor-core prefill path's probe
# (bench/probes/mma_check.py: self-check, fused = per-head, cost against sdpa), the bfloat16 first token
# by op (bench/probes/prefill_profile.py, chunks of 512 and 2,048), then ours beside mlx-lm in bfloat16
# at 511, 2,047 and 8,191 prompt tokens. From the repo root of the lent machine, after the MLX CUDA build
# and the peers' wheels were copied there (.mlxcuda2/, .peerwheels/: bench/h200.sh says how); writes $OUT.
source .mlxcuda2/setup.sh >/dev/null && SITE=/tmp/site bash .peerwheels/install.sh >/dev/null 2>&1
source .mlxcuda2/mlx-lm-stubs.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD MLXINFER_CACHE=/tmp/mc PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
T0=$SECONDS
(cd bench/probes && timeout 200 python3 mma_check.py --keys 512,2048,8192 --out $OUT/mma_check.jsonl 2>&1 | grep -v "^mlxinfer: compiling" | tail -5)
echo "[$((SECONDS-T0))s]"
(cd bench/probes && timeout 100 python3 prefill_profile.py --cases 511,2047,8191 --dtypes bfloat16 --runs 2 --out $OUT/prefill_bf16.jsonl 2>&1 | grep '^#\|rror')
echo "[$((SECONDS-T0))s]"
(cd bench/probes && timeout 60 python3 prefill_profile.py --cases 8191 --chunk 2048 --dtypes bfloat16 --runs 2 --out $OUT/prefill_bf16_2048.jsonl 2>&1 | grep '^#\|rror')
echo "[$((SECONDS-T0))s]"
timeout $((500 - SECONDS + T0)) python3 -m mlxinfer bench -m qwen3-0.6b-synthetic --backends mlx --devices gpu -p 511,2047,8191 -n 16 --batch 1 --runs 1 --rounds 2 --dtypes bfloat16 --prefill-chunks 2048 --peers mlx-lm --peer-dtypes bfloat16 --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$? [$((SECONDS-T0))s]"; grep -v "^  " $OUT/bench.log | tail -14
