#!/bin/bash
# Why a TP all-sum costs ~60 us on the lent 2xH200 host: the GPUs' link (nvidia-smi topo), the transport
# NCCL picks (NCCL_DEBUG=INFO, first launch only) and bench/probes/all_sum_latency.py under NCCL's protocol and
# algorithm settings. After `source .mlxcuda2/setup.sh`; writes $OUT/all-sum.jsonl and $OUT/nccl-info.log.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (the device tool's rule)
LAUNCH="python3 -c 'from mlx._distributed_utils.launch import main; main()'"
nvidia-smi topo -m 2>&1 | head -8
run() {  # run "VAR=value ..." : one launch with those NCCL variables
  echo "== ${1:-defaults}"
  local envs=""; for kv in $1; do envs="$envs --env $kv"; done
  eval timeout 120 $LAUNCH -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 $envs -- \
    python3 bench/probes/all_sum_latency.py --out "$OUT/all-sum.jsonl" 2>&1 | grep -v "^NCCL\|NCCL INFO" | tail -4
}
eval timeout 120 $LAUNCH -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 --env NCCL_DEBUG=INFO -- \
  python3 bench/probes/all_sum_latency.py --hidden 5120 --dtypes float32 --reps 5 >"$OUT/nccl-info.log" 2>&1
grep -E "via|Channel 00|NVLS|P2P|SHM|Using network|comm .* rank|Init COMPLETE|algorithm|protocol" "$OUT/nccl-info.log" | sort | uniq | head -30
for setting in ${SETTINGS:-"" "NCCL_PROTO=LL" "NCCL_PROTO=LL128" "NCCL_PROTO=Simple" "NCCL_ALGO=Tree" "NCCL_P2P_DISABLE=1"}; do
  run "$setting"
done
