#!/bin/bash
# The lent H200, issue 28's speed rows: the block kernels' GPU tests, decode per weight type, and our
# Q4_K_M beside our Q8_0 and mlx-lm's 4-bit models (group 32 and 64, bfloat16) on the Qwen3-0.6B and
# Qwen3-8B shapes (synthetic random blocks; mlx-lm's: random weights of the same shapes, mx.quantize).
# From the repo root, after `source .mlxcuda2/setup.sh` (MLX's CUDA build and mlx-lm):
#
#   OUT=DIR bash bench/quant_h200.sh [STEP...]     # steps: check tests products types small prefill large
#                                                  # (default: tests types small)
#
# check  `mlxinfer inspect --kernels`: the GPU self-check (attention kernels, long prefill chunks on
#        MLX's GEMMs, the block kernels), bit for bit
# tests  tests/test_block_kernels.py (every type's kernel against its published order, bit for bit, partial
#        tiles of x included), and the quantized experts on the GPU (tests/test_quants.py -k experts)
# products  bench/probes/block_products.py --types PTYPES (Q8_0,Q4_K,Q6_K,IQ4_XS,Q3_K,F16): one product
#        per decode shape of the 0.6B and 8B models, the kernels against MLX's quantized_matmul -> $OUT/products.jsonl
# types  bench/probes/decode_types.py --types TYPES (Q8_0,Q4_K,Q6_K) -> $OUT/types.jsonl
# small  mlxinfer bench on qwen3-0.6b-q4km-synthetic with mlx-lm 4:32 and 4:64 in bfloat16, then on
#        qwen3-0.6b-synthetic (Q8_0), prompts PROMPTS (17,511), 64 tokens, ROUNDS (2) rounds of RUNS (3)
# prefill the Q8_0 file beside mlx-lm's 8-bit model in bfloat16 at prompts LONG (2047,8191): time to first
#        token with long chunks on MLX's GEMMs
# large  the same on qwen3-8b-q4km-synthetic (prompt 17, mlx-lm 4:64), and MLX's active memory after
#        loading it beside the file's tensor bytes
# profile  where the 8B prompt pass's device time goes, Q4_K_M against Q8_0 (issue 28: Q4_K_M's first token
#        55 against 41 ms after 17 tokens, H100 2026-12-07): Nsight Compute (`ncu`, on the lent machines) of
#        bench/probes/ncu_step.py's prompt pass of 17 tokens on qwen3-8b-q4km-synthetic and qwen3-8b-synthetic
#        (each written on first use, ~1 min) -> $OUT/ncu-prefill-<file>.csv, summed by kernel name by
#        bench/probes/ncu_passes.py (~2-3 min a file); PROFILE_MODELS names other files (one a call on a fresh
#        machine, whose kernels compile first)
set -u
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ROUNDS=${ROUNDS:-2}; RUNS=${RUNS:-3}; TYPES=${TYPES:-Q8_0,Q4_K,Q6_K}; PROMPTS=${PROMPTS:-17,511}; LONG=${LONG:-2047,8191}
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*"; }
bench() {  # name model prompts peer-quant
  timeout "${BENCH_TIMEOUT:-400}" python3 -m mlxinfer bench -m "$2" --backends mlx --devices gpu --attention fused \
    -p "$3" -n 64 --batch 1 --runs "$RUNS" --rounds "$ROUNDS" --peers "$([ "$4" = none ] && echo none || echo mlx-lm)" \
    --peer-dtypes bfloat16 --peer-quant "${4/none/file}" ${EXTRA_BENCH:-} --out "$OUT/$1" >"$OUT/$1.log" 2>&1
  log "bench $1 rc=$?"; grep -v "^  " "$OUT/$1.log" | tail -14
}
for step in ${*:-tests types small}; do
  case $step in
    check) timeout 400 python3 -m mlxinfer inspect --kernels >"$OUT/check.log" 2>&1; tail -3 "$OUT/check.log"
           log "check" ;;
    tests) timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_block_kernels.py \
             tests/test_quants.py -k "not cpu and (experts or Q4_K or Q6_K or block or gpu)" >"$OUT/tests.log" 2>&1
           tail -5 "$OUT/tests.log"; log "tests" ;;
    products) timeout 400 python3 bench/probes/block_products.py --types "${PTYPES:-Q8_0,Q4_K,Q6_K,IQ4_XS,Q3_K,F16}" \
                --out "$OUT/products.jsonl" 2>&1 | tail -4
              log "products" ;;
    types) timeout 300 python3 bench/probes/decode_types.py --types "$TYPES" --runs 3 --out "$OUT/types.jsonl" 2>&1 | tail -12
           log "types" ;;
    small) bench q4km-0.6b qwen3-0.6b-q4km-synthetic "$PROMPTS" 4:32,4:64
           bench q8-0.6b qwen3-0.6b-synthetic "$PROMPTS" none ;;
    prefill) bench prefill-0.6b qwen3-0.6b-synthetic "$LONG" file ;;
    large) bench q4km-8b qwen3-8b-q4km-synthetic 17 4:64
           python3 - <<'PY'
import mlx.core as mx, mlxinfer
from mlxinfer.benchmark import model_path
from mlxinfer.gguf_file import GGUFFile
p = model_path("qwen3-8b-q4km-synthetic")
with GGUFFile(p) as g:
    file_bytes = sum(t.nbytes for t in g.tensors.values())
mx.reset_peak_memory()
e = mlxinfer.load(p, backend="mlx")
act = mx.get_active_memory()
print(f"8B Q4_K_M: tensor bytes {file_bytes / 2**30:.2f} GiB, MLX active after load {act / 2**30:.2f} GiB ({act / file_bytes:.3f}x)")
PY
           log "large" ;;
    profile) for m in ${PROFILE_MODELS:-qwen3-8b-q4km-synthetic qwen3-8b-synthetic}; do
               timeout "${PROFILE_TIMEOUT:-280}" ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
                 --print-units base python3 bench/probes/ncu_step.py -m "$m" -p 17 --tokens 1 \
                 >"$OUT/ncu-prefill-$m.csv" 2>"$OUT/ncu-prefill-$m.err"
               log "profile $m rc=$?"; python3 bench/probes/ncu_passes.py "$OUT/ncu-prefill-$m.csv" --top 16 --passes 0
             done ;;
    *) log "unknown step $step"; exit 1 ;;
  esac
done
