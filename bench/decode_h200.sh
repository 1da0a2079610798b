#!/bin/bash
# Issue 10 on one lent H200, one device call, from the repo root (after `source .mlxcuda2/setup.sh`):
#   OUT=... bash bench/decode_h200.sh
# 1. the GPU tests of the attention kernels and the compiled step (tests/test_kernels.py, test_mlx_backend.py,
#    test_compile.py, test_cuda_limits.py; STEPS=tests), 2. bench/decode_attention.py (our kernels vs
#    mx.fast.sdpa; STEPS=micro), 3. bench/bench.py against mlx-lm at the CASES prompts (STEPS=bench),
# 4. bench/attention_plans.py (prefill and decode with each attention launch plan; STEPS=plans),
# 5. bench/step_profile.py (host time per decode token, ours and mlx-lm's, at MLX's default CUDA graph size
#    and at 1000 ops per graph (OPS_PER_GRAPH: the list; STEPS=profile), 6. the device time alone (GPU clock stamps) of each
#    attention op and of the whole decode step, ours and mlx-lm's (STEPS=gpuclock).
# 7. bench/ab_trees.py: this tree against B_TREE by decode token intervals (STEPS=ab). ROUNDS: bench.py --rounds.
# Durations on a lent H200: tests ~170 s on a fresh machine (2026-11-30; with all four files and 5 examples
# 290 s, and more than 330 s on 2026-12-01 with more kernels to compile: give TESTS_TIMEOUT=450), micro ~30 s,
# plans ~150 s, bench 160-220 s (--rounds 3 at 17 and 511 tokens: ~110 s), ab (4 rounds) ~150 s: a device
# call holds at most 600 s, so run tests and the rest in two calls.
# Writes $OUT/tests.log, $OUT/decode-attention.jsonl, $OUT/bench/ (results.jsonl, results.md, plot), $OUT/bench.log.
# A lent machine's copy of the tree carries stale git metadata: pass MLXINFER_COMMIT=<this checkout's HEAD>
# so bench.py's header names the code (it also prints a digest of the sources, bench.py source_digest).
set -u
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}"
STEPS=${STEPS:-tests micro bench}; CASES=${CASES:-17,511,8191}; RUNS=${RUNS:-3}  # BATCH: bench.py --batch (1)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*"; }
for step in $STEPS; do
  case $step in
    tests)
      MLXINFER_PROPERTY_EXAMPLES=${EXAMPLES:-40} timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -x -p no:cacheprovider -rfEs \
        -k "not smollm2 and not cpu_product_threads and not cpu_threads_work" \
        ${TESTS:-tests/test_kernels.py tests/test_mlx_backend.py tests/test_compile.py tests/test_cuda_limits.py} \
        >"$OUT/tests.log" 2>&1; rc=$?
      tail -5 "$OUT/tests.log"; log "tests rc=$rc"; [ $rc -eq 0 ] || exit 1 ;;
    micro)
      timeout ${MICRO_TIMEOUT:-200} python3 bench/decode_attention.py --contexts 512,2048,8192,32768 --batch 1,8 \
        --out "$OUT/decode-attention.jsonl"; log "decode_attention rc=$?" ;;
    plans)
      timeout ${PLANS_TIMEOUT:-300} python3 bench/attention_plans.py --cases "${PLAN_CASES:-17,511,2047,8191}" \
        --plans "${PLANS:-one-launch,split,auto}" \
        --out "$OUT/attention-plans.jsonl"; log "attention_plans rc=$?" ;;
    profile)
      for ops in ${OPS_PER_GRAPH:-default 1000}; do
        if [ "$ops" = default ]; then unset MLX_MAX_OPS_PER_BUFFER; else export MLX_MAX_OPS_PER_BUFFER=$ops; fi
        timeout ${PROFILE_TIMEOUT:-150} python3 bench/step_profile.py --cases "${PROFILE_CASES:-17,511}" \
          --variants "${VARIANTS:-default,separate,one-launch,no-attention}" --out "$OUT/step-profile.jsonl"
        log "step_profile (ops per graph: $ops) rc=$?"
      done
      unset MLX_MAX_OPS_PER_BUFFER ;;
    gpuclock)
      timeout ${MICRO_TIMEOUT:-200} python3 bench/decode_attention.py --gpu-clock --contexts 512,2048,8192,32768 \
        --batch 1,8 --out "$OUT/decode-attention-gpu.jsonl"; log "decode_attention --gpu-clock rc=$?"
      timeout ${PROFILE_TIMEOUT:-200} python3 bench/step_profile.py --gpu-clock --cases "${PROFILE_CASES:-17,511}" \
        --variants "${VARIANTS:-default,no-attention}" --out "$OUT/step-profile-gpu.jsonl"
      log "step_profile --gpu-clock rc=$?" ;;
    bench)
      timeout ${BENCH_TIMEOUT:-400} python3 bench/bench.py --backends mlx --devices gpu --attention fused --runs "$RUNS" --batch "${BATCH:-1}" \
        --cases "$CASES" --rounds "${ROUNDS:-1}" --peers mlx-lm --out "$OUT/bench" >"$OUT/bench.log" 2>&1; rc=$?
      tail -25 "$OUT/bench.log"; log "bench rc=$rc" ;;
    ab)  # this tree (A) against another copy of the engine (B_TREE, e.g. made here with
         # `git archive <rev> mlxinfer metal_kernels bench | tar -x -C abB`: a lent machine's git is stale)
      timeout ${AB_TIMEOUT:-400} python3 bench/ab_trees.py --a-tree . --b-tree "${B_TREE:?set B_TREE}" \
        --rounds "${AB_ROUNDS:-4}" --cases "${AB_CASES:-17,511}" --out "$OUT/ab" >"$OUT/ab.log" 2>&1; rc=$?
      tail -12 "$OUT/ab.log"; log "ab_trees rc=$rc" ;;
  esac
done
