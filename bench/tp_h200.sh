#!/bin/bash
# Tensor parallelism on two GPUs of one host (the device tool's nvidia-h200-x2), after MLX CUDA is set up
# (`source .mlxcuda2/setup.sh`): writes a synthetic Qwen3-14B-shaped Q8_0 model (random blocks, ~15.7 GB),
# then bench/tp_bench.py at TP=1 (one process, one GPU) and TP=2 (mlx.launch, NCCL, one GPU per rank),
# then the CLI as a user runs it (`mlxinfer generate --tp 2`). JSON lines and logs go to ${OUT:-/tmp/out}.
#   SHAPE=14b|32b  CASES=17,511  GEN=64  RUNS=3  NCCL_EXTRA="NCCL_PROTO=LL ..." (passed to the TP=2 ranks)
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the scripts import this tree's mlxinfer
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (the device tool's rule)
SHAPE=${SHAPE:-14b}
case $SHAPE in
  14b) DIMS="--layers 40 --hidden 5120 --ffn 17408 --heads 40 --kv-heads 8 --head-dim 128" ;;
  32b) DIMS="--layers 64 --hidden 5120 --ffn 25600 --heads 64 --kv-heads 8 --head-dim 128" ;;
esac
M=/tmp/qwen3-$SHAPE-synthetic-q8_0.gguf
LAUNCH="python3 -c 'from mlx._distributed_utils.launch import main; main()'"
[ -f "$M" ] || { /usr/bin/time -f "write model %e s" python3 -m mlxinfer.synthetic "$M" --arch qwen3 $DIMS \
  --vocab 151936 --untied --type Q8_0 --random-blocks 2>&1 | tail -1; ls -l "$M"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
ARGS="--cases ${CASES:-17,511} --gen ${GEN:-64} --runs ${RUNS:-3} --out $OUT/tp.jsonl"
echo "== TP=1"; python3 bench/tp_bench.py "$M" --tp 1 $ARGS 2>&1 | tail -3
X=""; for kv in ${NCCL_EXTRA:-}; do X="$X --env $kv"; done
echo "== TP=2 ${NCCL_EXTRA:-}"; eval $LAUNCH -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 $X -- python3 bench/tp_bench.py "$M" --tp 2 $ARGS 2>&1 | tail -4
echo "== CLI"; python3 -m mlxinfer generate --raw "The capital of France is" --model "$M" --max-tokens 16 --tp 2 2>&1 | tail -16
