#!/bin/bash
# MLX's CUDA kernel cache carried from one lent machine to the next. A fresh machine compiles every form of
# our kernels (and MLX's own JIT kernels) before the first token and again through the GPU tests: minutes
# of a device call (mlxinfer/cuda_jit.py writes ours into the cache MLX reads, MLX_PTX_CACHE_DIR). Carried
# back and forth, a later machine of the same GPU architecture compiles only the kernels whose source
# changed since (MLX names a module by a hash of its source; cuda_jit's stamp file names its builder).
#
#   source bench/ptx_cache.sh restore   # on the lent machine, before MLX starts: MLX_PTX_CACHE_DIR=/tmp/ptx,
#                                       # .ptxcache/ptx.tar.xz unpacked there where the call carries it
#   bash bench/ptx_cache.sh save        # after: the cache packed into $OUT/ptx.tar.xz (under 16 MiB, what a
#                                       # call returns; nothing is written if larger)
#
# Here, after the call: `mkdir -p .ptxcache && cp <files_at>/ptx.tar.xz .ptxcache/` (git-ignored: add
# `/.ptxcache/` to .git/info/exclude), and carry `.ptxcache` with the next call (64 MiB a call in all).
case ${1:-} in
  restore)
    export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptx}
    mkdir -p "$MLX_PTX_CACHE_DIR"
    if [ -f .ptxcache/ptx.tar.xz ]; then
      tar xJf .ptxcache/ptx.tar.xz -C "$MLX_PTX_CACHE_DIR" && echo "ptx cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files restored"
    fi ;;
  save)
    : "${OUT:?set OUT}" "${MLX_PTX_CACHE_DIR:=/tmp/ptx}"
    tar cf - -C "$MLX_PTX_CACHE_DIR" . | xz -T0 -6 > "$OUT/ptx.tar.xz.tmp" || exit 1
    if [ "$(stat -c %s "$OUT/ptx.tar.xz.tmp")" -lt $((16 << 20)) ]; then
      mv "$OUT/ptx.tar.xz.tmp" "$OUT/ptx.tar.xz" && echo "ptx cache: saved $(du -h "$OUT/ptx.tar.xz" | cut -f1)"
    else
      rm -f "$OUT/ptx.tar.xz.tmp"; echo "ptx cache: over 16 MiB packed, not saved" >&2
    fi ;;
  *) echo "usage: source bench/ptx_cache.sh restore | bash bench/ptx_cache.sh save" >&2; return 2 2>/dev/null || exit 2 ;;
esac
