#!/bin/bash
# The lent H200: the GPU test suite, then `mlxinfer bench` beside mlx-lm in float32 and bfloat16 on the
# synthetic Qwen3-0.6B shape. From the repo root, after `source .mlxcuda2/setup.sh` (MLX's CUDA build and
# mlx-lm; the machine has no package registry, so wheels are carried):
#
#   OUT=DIR bash bench/h200.sh [STEP...]      # steps: tests archs fused bench report (default: tests archs bench report)
#
# tests   the five GPU test files (test_kernels, test_mlx_backend, test_compile, test_cuda_limits, test_sdpa_prefill;
#         or TEST_FILES) with EXAMPLES Hypothesis examples (5) -> $OUT/tests.log; in WORKERS (4) processes
#         where pytest-xdist is importable or carried in .testwheels/ (bench/peerwheels/make.sh makes it).
#         In one process they outgrew a call (docs/performance.md), so carry .testwheels, or split
#         them with TEST_FILES over calls
# archs   every architecture against llama.cpp's fixtures and the windowed cache, the "mlx" rows on the GPU
#         (test_models, test_window_cache) -> $OUT/archs.log
# fused   the block kernels' ADD, NORM and SWIGLU forms and the rms_norm and swiglu kernels: their GPU tests in
#         bfloat16 (self-check, a model fused = apart bit for bit) -> $OUT/fused-tests.log, then the decode
#         step's host parts with them (default) and without (unfused) beside mlx-lm, bfloat16, prompts
#         CASES_FUSED (17,511) -> $OUT/fused-profile.jsonl (bench/probes/step_profile.py)
# bench   mlxinfer bench --backends mlx --devices gpu at the prompt lengths CASES (17,511,8191), batch
#         sizes BATCH (1,8,32), ROUNDS rounds (3) of RUNS runs (3), mlx-lm in DTYPES (float32,bfloat16),
#         ours in OURS (float32,bfloat16: --dtypes) with KV_DTYPE (empty: each dtype's own; q8_0 ...)
#         -> $OUT/bench-<cases>-b<batch>/ (results.jsonl, results.md with the command and table,
#         results.png where matplotlib is installed) and bench-<cases>-b<batch>.log
# report  one table (and plot) of every $OUT/bench-*/results.jsonl -> $OUT/report/ (runs `mlxinfer bench
#         --report`; also works here on fetched results, where matplotlib is)
#
# All steps in one go suit a machine without a time limit. A device call holds at most 600 s and a fresh
# machine compiles the self-check's kernels first (into MLX's cache, on every core: ~70 s in float32 and
# ~46 s more for bfloat16 on an H200, 2026-12-03; seconds in later processes), so there: one call a step, and the bench step split by CASES and
# BATCH. The tests took 300-440 s in one process until 2026-12-03 (TESTS_TIMEOUT 560; more since, above). Estimates from runs with one mlx-lm dtype: CASES=17
# or CASES=511 with the default batches and rounds ~5 min each, CASES=8191 BATCH=1 ~3 min. At 8,191
# tokens batch B's prefill is B times batch 1's (ours takes 5.3 s a sequence), so CASES=8191 BATCH=8
# (~40 s a run, ~10 min in three rounds) and BATCH=32 (~170 s a run; its KV cache ~60 GB in float32) do
# not fit one call with the default rounds and runs: give them calls of their own with fewer (RUNS=1
# ROUNDS=1, WARMUP=512 for a short warm-up prompt) and say so beside their figures. BENCH_TIMEOUT (570)
# bounds each bench step; rows are written as measured, so a step it stops keeps what it measured.
#
# The compiled kernels: every step restores a carried .ptxcache/ptx.tar.xz into MLX_PTX_CACHE_DIR and
# saves the cache to $OUT/ptx.tar.xz at the end (bench/ptx_cache.sh), so that the next machine does not
# compile them again.
#
# .peerwheels/ (git-ignored; `bash bench/peerwheels/make.sh` makes it) is unpacked into SITE (/tmp/site)
# when carried: mlx-lm's own imports. A lent machine's copy of the tree carries stale git metadata: pass
# MLXINFER_COMMIT=<this checkout's HEAD> so the JSON header names the code (it also holds a digest of
# the sources).
set -u
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}"
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
if [ -f .peerwheels/install.sh ]; then
  SITE=$SITE bash .peerwheels/install.sh || exit 1
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
source bench/ptx_cache.sh restore  # the kernel cache a call carried (.ptxcache/), saved to $OUT at the end
trap 'bash bench/ptx_cache.sh save' EXIT
CASES=${CASES:-17,511,8191}; BATCH=${BATCH:-1,8,32}; ROUNDS=${ROUNDS:-3}; RUNS=${RUNS:-3}
DTYPES=${DTYPES:-float32,bfloat16}; WARMUP=${WARMUP:-0}; OURS=${OURS:-float32,bfloat16}; KV_DTYPE=${KV_DTYPE:-}
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*"; }
for step in ${*:-tests archs bench report}; do
  case $step in
    tests)
      xdist=()
      if [ -d .testwheels ]; then  # pytest-xdist carried (bench/peerwheels/make.sh): WORKERS processes share the GPU
        python3 -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob('.testwheels/*.whl')]" "$SITE"
        export PYTHONPATH=$SITE:$PYTHONPATH
      fi
      python3 -c "import xdist" 2>/dev/null && [ "${WORKERS:-4}" -gt 1 ] && xdist=(-n "${WORKERS:-4}")
      MLXINFER_TEST_OFFLINE=1 MLXINFER_PROPERTY_EXAMPLES=${EXAMPLES:-5} timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -x "${xdist[@]}" \
        -p no:cacheprovider -rfEs -k "not smollm2 and not cpu_product_threads and not cpu_threads_work" \
        ${TEST_FILES:-tests/test_kernels.py tests/test_mlx_backend.py tests/test_compile.py tests/test_cuda_limits.py tests/test_sdpa_prefill.py} \
        >"$OUT/tests.log" 2>&1; rc=$?
      tail -5 "$OUT/tests.log"; log "tests rc=$rc"; [ $rc -eq 0 ] || exit 1 ;;
    fused)
      MLXINFER_TEST_OFFLINE=1 timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/test_block_kernels.py -k "bfloat16 and (gpu_norms or gpu_norm_and_swiglu or gpu_mixed or gpu_self_check_of_the_block)" \
        >"$OUT/fused-tests.log" 2>&1; rc=$?
      tail -3 "$OUT/fused-tests.log"; log "fused tests rc=$rc"
      timeout "${BENCH_TIMEOUT:-300}" python3 bench/probes/step_profile.py --cases "${CASES_FUSED:-17,511}" --gen 64 \
        --dtypes bfloat16 --variants default,unfused --out "$OUT/fused-profile.jsonl" >"$OUT/fused-profile.log" 2>&1
      log "fused profile rc=$?"; grep -i "warning" "$OUT/fused-profile.log" | head -5 ;;
    archs)
      timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -x -p no:cacheprovider -rfEs \
        tests/test_models.py tests/test_window_cache.py >"$OUT/archs.log" 2>&1; rc=$?
      tail -5 "$OUT/archs.log"; log "archs rc=$rc"; [ $rc -eq 0 ] || exit 1 ;;
    bench)
      d=$OUT/bench-${CASES//,/-}-b${BATCH//,/-}
      timeout "${BENCH_TIMEOUT:-570}" python3 -m mlxinfer bench -m qwen3-0.6b-synthetic --backends mlx \
        --devices gpu --attention fused -p "$CASES" -n 64 --batch "$BATCH" --runs "$RUNS" --rounds "$ROUNDS" \
        --warmup-tokens "$WARMUP" --peers mlx-lm --peer-dtypes "$DTYPES" --dtypes "$OURS" \
        ${KV_DTYPE:+--kv-dtype "$KV_DTYPE"} --out "$d" >"$d.log" 2>&1; rc=$?
      grep -v "^  " "$d.log" | tail -40; log "bench $d rc=$rc" ;;
    report)
      python3 -m mlxinfer bench --report "$OUT"/bench-*/results.jsonl --out "$OUT/report"; log "report rc=$?" ;;
    *) log "unknown step $step (tests, bench, report)"; exit 1 ;;
  esac
done
