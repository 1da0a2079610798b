#!/bin/bash
# The first use of our CUDA kernels on a fresh machine (the lent H200): what `cuda_jit` prebuilds and
# whether MLX loads it (bench/probes/cuda_jit_probe.py), then `mlxinfer inspect --kernels` twice (the
# first process compiles every form of the self-check at once, the second finds them on disk), the
# kernels' GPU tests, then BENCH (a `mlxinfer bench` argument string) in whatever is left of LIMIT s.
# From the repo root, after `source .mlxcuda2/setup.sh` (MLX's CUDA build):
#
#   OUT=DIR [LIMIT=560] [BENCH="-m qwen3-0.6b-synthetic ..."] bash bench/first_use_h200.sh
set -u
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*"; }
timeout 90 python3 bench/probes/cuda_jit_probe.py 2>&1 | tail -6; log "probe"
for i in 1 2; do
  T=$SECONDS
  timeout 240 python3 -m mlxinfer inspect --kernels >"$OUT/inspect$i.log" 2>&1
  echo "rc=$? $(tail -c 600 "$OUT/inspect$i.log")"; log "inspect --kernels ($i): $((SECONDS - T)) s"
done
echo "modules in MLX's cache: $(find "${MLX_PTX_CACHE_DIR:-/tmp/mlx}" -name '*.ptx' | wc -l)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_cuda_jit.py tests/test_block_kernels.py \
  >"$OUT/tests.log" 2>&1; tail -6 "$OUT/tests.log"; log "tests"
if [ -n "${BENCH:-}" ]; then
  left=$(( ${LIMIT:-560} - (SECONDS - T0) ))
  timeout "$left" python3 -m mlxinfer bench $BENCH --out "$OUT/bench" >"$OUT/bench.log" 2>&1
  log "bench rc=$?"; grep -v "^  " "$OUT/bench.log" | tail -16
fi
