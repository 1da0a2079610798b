#!/bin/bash
# Issue 11: mlx-lm's server and ours on the same synthetic Qwen3-0.6B-shaped Q8_0 weights, one after the other,
# bench/serve_bench.py at concurrency 1, 8 and 32 against each. One device call, from the repo root:
#   bash bench/serve_h200.sh   (needs $OUT; MLX in $SITE=/tmp/site from .mlxcuda2/setup.sh; carry .mlxcuda2 and
#   .peerwheels, the git-ignored wheels that `bash bench/peerwheels/make.sh` makes)
# Writes $OUT/mlxlm.jsonl, $OUT/ours.jsonl (serve_bench's JSON lines, engine labels filled in), $OUT/probe.jsonl
# (one greedy request each: usage, text), $OUT/write.log, $OUT/mlxlm_server.log, $OUT/ours_server.log.
# Every step is bounded (LEVEL_TIMEOUT per bench level, 300 s per server start and per probe request).
# Knobs (env): PAIRS ("reuse": mlx-lm's defaults, its prompt cache on, against ours with --kv paged, whose prefix
# reuse is on; "noreuse": mlx-lm --prompt-cache-size 0 against ours --kv prealloc; "reuse noreuse": both, ~2x the
# time), SYN (synthetic shape), TOK (max_tokens, 64), BACKEND (mlx), LEVEL_TIMEOUT (s per bench level, 120).
set -u
cd "$(dirname "$0")/.." || exit 1
: "${OUT:?set OUT}"
SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SYN=${SYN:---layers 28 --hidden 1024 --ffn 3072 --heads 16 --kv-heads 8 --head-dim 128}
TOK=${TOK:-64}; BACKEND=${BACKEND:-mlx}; LT=${LEVEL_TIMEOUT:-120}
GG=${GG:-/tmp/q.gguf}; MD=${MD:-/tmp/q_mlx}
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*"; }
SITE=$SITE bash .peerwheels/install.sh || exit 1
python3 -c "import mlx.core as mx, mlx_lm, transformers; print('mlx', mx.__version__, mx.default_device(), mx.device_info().get('device_name', ''), '| mlx-lm', mlx_lm.__version__, '| transformers', transformers.__version__)" || exit 1
[ -s "$GG" ] || python3 -m mlxinfer.synthetic "$GG" --arch qwen3 $SYN --vocab 151936 --type Q8_0 || exit 1
log "synthetic GGUF $GG"
W=; [ -s "$MD/model.safetensors" ] && [ -s "$MD/tokenizer.json" ] && W=--no-write  # a later call on the same machine
python3 bench/mlx_lm_server_peer.py "$GG" "$MD" $W >"$OUT/write.log" 2>&1 || { cat "$OUT/write.log"; exit 1; }
grep -E "^wrote|^token ids|^check" "$OUT/write.log"
log "mlx-lm model dir $MD written, token ids checked"

PID=
up() {  # wait until port $1 answers /v1/models (at most 300 s), while process $PID lives
  for _ in $(seq 600); do
    kill -0 "$PID" 2>/dev/null || { log "server on port $1 exited"; return 1; }
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$1/v1/models', timeout=2).status_code != 200)" 2>/dev/null && return 0
    sleep 0.5
  done
  log "server on port $1 not up after 300 s"; return 1
}
stop() { kill "$PID" 2>/dev/null; for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || return 0; sleep 0.5; done; kill -9 "$PID"; }
probe() {  # port model-id engine-label: one greedy chat request with the bench's prompt -> $OUT/probe.jsonl
  python3 - "$@" >>"$OUT/probe.jsonl" <<'P' || log "probe failed"
import httpx, json, sys
from bench.serve_bench import bench_prompt
r = httpx.post(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", timeout=300, json=dict(model=sys.argv[2],
    messages=[{"role": "user", "content": bench_prompt()}], max_tokens=16, temperature=0)).json()
print(json.dumps(dict(engine=sys.argv[3], usage=r.get("usage"), text=r["choices"][0]["message"]["content"])))
P
}
bench() {  # port model-id out-file engine-label
  local b="python3 bench/serve_bench.py --url http://127.0.0.1:$1/v1 --model-id $2 --timeout $LT"
  probe "$1" "$2" "$4"
  # warm-up at every batch size, not recorded (MLX compiles CUDA kernels on first use)
  $b --concurrency 32,8 --requests 32 --max-tokens 16 >/dev/null 2>&1 || log "warm-up failed"
  $b --concurrency 1 --requests 8 --max-tokens "$TOK" --out "$3.tmp" | tail -n 3
  $b --concurrency 8,32 --requests 64 --max-tokens "$TOK" --out "$3.tmp" | tail -n 4
  sed "s/\"engine\": \"peer\"/\"engine\": \"$4\"/" "$3.tmp" >>"$3"; rm -f "$3.tmp"
  log "bench $4 done"
}
run_mlxlm() {  # label, extra mlx_lm.server flags...
  local label=$1; shift
  python3 bench/mlx_lm_server_peer.py "$GG" "$MD" --no-write --no-check --serve --port 8792 -- --log-level WARNING "$@" >>"$OUT/mlxlm_server.log" 2>&1 &
  PID=$!
  up 8792 && { log "mlx_lm.server up ($label)"; bench 8792 default_model "$OUT/mlxlm.jsonl" "$label"; }
  stop
}
run_ours() {  # label, kv
  python3 -m mlxinfer serve --backend "$BACKEND" --model "$GG" --kv "$2" --max-batch 32 --max-queue 256 --port 8791 >>"$OUT/ours_server.log" 2>&1 &
  PID=$!
  up 8791 && { log "mlxinfer serve up ($1)"; bench 8791 "$(basename "$GG")" "$OUT/ours.jsonl" "$1"; }
  stop
}
V=$(python3 -c "import mlx_lm; print(mlx_lm.__version__)")
for pair in ${PAIRS:-reuse}; do
  case $pair in
    reuse) run_mlxlm "mlx-lm $V server"; run_ours "mlxinfer $BACKEND (paged)" paged ;;
    noreuse) run_mlxlm "mlx-lm $V server (prompt cache off)" --prompt-cache-size 0
             run_ours "mlxinfer $BACKEND (prealloc)" prealloc ;;
    *) log "unknown pair $pair" ;;
  esac
done
[ -s "$OUT/probe.jsonl" ] && python3 - "$OUT/probe.jsonl" <<'P'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(r["engine"], "| prompt_tokens", (r["usage"] or {}).get("prompt_tokens"), "| text", repr(r["text"]))
print("same prompt_tokens:", len({(r["usage"] or {}).get("prompt_tokens") for r in rows}) == 1,
      "| same greedy text:", len({r["text"] for r in rows}) == 1)
P
log "all done"
