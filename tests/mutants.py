"""The deliberate bugs of tests/README.md, and a runner that tries them: each bug is applied to a copy of
the tree (never to the working tree), its tests run there, and the copy is restored.

    python3 tests/mutants.py --list                 # the catalogue
    python3 tests/mutants.py                        # every bug: one line each, CAUGHT (first failing test) or NOT CAUGHT
    python3 tests/mutants.py kv-reserve-not-growing att-tile-mask-offset

A bug is (id, class, file, [(old, new), ...], tests to run, description); each `old` must occur exactly
once in the file, and a bug whose text no longer occurs (the code changed) is reported as not applying:
update its strings when you change the code it targets. The copy's own `mlxinfer` is the one imported
(pytest runs with the copy as its working directory, ahead of the editable install). Children run under
a 6 GB address-space limit: with a chat-template bound removed, a hostile template would otherwise
allocate until the machine swaps. Not collected by pytest (not a test_*.py file).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

T_ATT = "tests/test_attention.py"
T_GEN = "tests/test_generate.py"
T_MOD = "tests/test_models.py"
T_MLX = "tests/test_mlx_backend.py"
T_TOK = "tests/test_tokenizer.py"
T_CHAT = "tests/test_chat_template.py"
T_CLI = "tests/test_cli.py"
T_TR = "tests/test_tracing.py"
T_KER = "tests/test_kernels.py"
T_SRV = "tests/test_server.py"
T_TP = "tests/test_tp.py"
T_WG = "tests/test_weight_groups.py"
T_COMP = "tests/test_compile.py"
T_BENCH = "tests/test_bench.py"
T_PPL = "tests/test_perplexity.py"

CPU = "mlxinfer/backends/cpu.py"
MLX = "mlxinfer/backends/mlx.py"
BACK = "mlxinfer/backend.py"
BATCH = "mlxinfer/batch.py"
KV = "mlxinfer/kv_cache.py"
LOOP = "mlxinfer/loop.py"
ENG = "mlxinfer/engine.py"
STEP = "mlxinfer/decode_step.py"
BLOCKS = "mlxinfer/block_manager.py"
SAMP = "mlxinfer/sampling.py"
TOK = "mlxinfer/tokenizer.py"
CHAT = "mlxinfer/chat.py"
CLI = "mlxinfer/cli.py"
TRACE = "mlxinfer/tracing.py"
LAYERS = "mlxinfer/models/layers.py"
QWEN = "mlxinfer/models/qwen3.py"
LLAMA = "mlxinfer/models/llama.py"
KERN = "mlxinfer/kernels.py"
SCHED = "mlxinfer/scheduler.py"
KVF = "mlxinfer/kv_cache.py"
SRV_ROUTES = "mlxinfer/server/routes.py"
SRV_ERRORS = "mlxinfer/server/errors.py"
SRV_BODY = "mlxinfer/server/body_limit.py"
SRV_METRICS = "mlxinfer/server/metrics.py"
SHARD = "mlxinfer/models/shard.py"
COLL = "mlxinfer/collectives.py"
GGUF = "mlxinfer/gguf_file.py"
BENCH = "mlxinfer/benchmark.py"
PEERS = "mlxinfer/peers.py"
PPL = "mlxinfer/perplexity.py"

ONLINE_SOFTMAX = '''

def _online_softmax(x):
    """Softmax in two key blocks with a running max and rescaled sum (flash-attention style)."""
    h = max(1, x.shape[-1] // 2)
    m1 = np.max(x[..., :h], axis=-1, keepdims=True)
    s1 = np.sum(np.exp(x[..., :h] - m1), axis=-1, keepdims=True)
    m = np.maximum(m1, np.max(x[..., h:], axis=-1, keepdims=True)) if x.shape[-1] > h else m1
    s = s1 * np.exp(m1 - m) + np.sum(np.exp(x[..., h:] - m), axis=-1, keepdims=True)
    return np.exp(x - m) / s
'''

M = [
    # -- attention -------------------------------------------------------------------------------
    ("att-scale-q-first", "attention", CPU,
     [("np.matmul(qh[h], kh[h // group].T, out=scores[h - h0])",
       "np.matmul(qh[h] * np.float32(spec.scale), kh[h // group].T, out=scores[h - h0])"),
      ("attn = self._scores_to_probabilities(scores, spec.scale, biases)",
       "attn = self._scores_to_probabilities(scores, 1.0, biases)")],
     [T_ATT], "cpu override: q scaled before the product instead of the scores after"),
    ("att-products-on-blas-threads", "attention", CPU,
     [("            with one_blas_thread():  # the reference's one-thread calls, whatever the thread count\n",
       "            if True:\n"),
      ("        with one_blas_thread():  # the same bits on any thread count (module docstring)\n",
       "        if True:\n")],
     [T_ATT], "cpu backend: attention's activation products on all BLAS threads (their bits then follow the thread count)"),
    ("att-divide-sqrt-d", "attention", CPU,
     [("block *= np.float32(scale)", "block /= np.float32(spec.head_dim ** 0.5)")],
     [T_ATT], "cpu override: scores divided by sqrt(d) instead of multiplied by the float32 reciprocal"),
    ("att-float64-softmax", "attention", CPU,
     [("            _softmax_last_axis(block, in_place=True)",
       "            block[...] = (lambda e: e / e.sum(-1, keepdims=True))"
       "(np.exp(block.astype(np.float64) - block.max(-1, keepdims=True)))")],
     [T_ATT], "cpu override: softmax in float64"),
    ("att-online-softmax", "attention", CPU,
     [("            _softmax_last_axis(block, in_place=True)", "            block[...] = _online_softmax(block)"),
      ("class CPUBackend(Backend):", ONLINE_SOFTMAX.strip("\n") + "\n\n\nclass CPUBackend(Backend):")],
     [T_ATT], "cpu override: online (two-block, running max) softmax"),
    ("att-threaded-heads-skip-first", "attention", CPU,
     [("list(self._threads().map(lambda h: task(h, h + 1), range(heads)))",
       "list(self._threads().map(lambda h: task(h, h + 1), range(1, heads)))")],
     [T_ATT], "cpu override: a long chunk's first head never computed on the threaded path"),
    ("att-threaded-scratch-shared", "attention", CPU,
     [('buf = getattr(self._local, "scores", None)', 'buf = getattr(self, "_shared_scores", None)'),
      ("buf = self._local.scores = np.empty(n, dtype=np.float32)", "buf = self._shared_scores = np.empty(n, dtype=np.float32)")],
     [T_ATT], "cpu override: the threads' head tasks share one score buffer"),
    ("att-tile-mask-first-head-only", "attention", CPU,
     [("for h in range(a // t, (b - 1) // t + 1):", "for h in range(a // t, a // t + 1):")],
     [T_ATT], "cpu override: only the first head of each tile masked"),
    ("att-tile-mask-offset", "attention", CPU,
     [("_add_biases(rows[r0:r1], biases, r0 - h * t, r1 - h * t)", "_add_biases(rows[r0:r1], biases, r0 - a, r1 - a)")],
     [T_ATT], "cpu override: a tile that starts inside a head masks with the wrong query positions"),
    ("att-bias-cache-key-ignores-positions", "attention", CPU,
     [("key = (positions.tobytes(), s, causal, window)", "key = (s, causal, window)")],
     [T_ATT, T_GEN], "cpu mask biases reused for another pass with the same S (stale positions)"),
    ("att-bias-zero-not-exact", "attention", CPU,
     [("np.where(hidden, np.float32(-np.inf), np.float32(0.0))))\n    if window:",
       "np.where(hidden, np.float32(-np.inf), np.float32(1e-3))))\n    if window:")],
     [T_ATT], "cpu causal bias adds 1e-3 (not 0) to the seen keys"),
    ("att-gqa-mod-reference", "attention", BACK,
     [("kv_h = h // spec.group", "kv_h = h % spec.n_kv_heads")],
     [T_ATT], "per-head reference: GQA kv head h % KV instead of h // group"),
    ("att-gqa-mod-override", "attention", CPU,
     [("np.matmul(qh[h], kh[h // group].T, out=scores[h - h0])", "np.matmul(qh[h], kh[h % kvh].T, out=scores[h - h0])"),
      ("np.matmul(attn[h - h0], vh[h // group], out=ctx[h])", "np.matmul(attn[h - h0], vh[h % kvh], out=ctx[h])")],
     [T_ATT], "cpu override: query heads h with h % KV == j read KV head j"),
    ("att-gqa-mod-mlx", "attention", MLX,
     [("qh = mx.contiguous(mx.transpose(mx.reshape(q[r0:r1], (t, kvh, group, d)), (1, 2, 0, 3)))",
       "qh = mx.contiguous(mx.transpose(mx.reshape(q[r0:r1], (t, group, kvh, d)), (2, 1, 0, 3)))")],
     [T_MLX], "mlx graph override: heads grouped h % KV (output order unchanged)"),
    ("att-causal-off-by-one", "attention", CPU,
     [("lo = int(positions.min()) + 1", "lo = int(positions.min()) + 2")],
     [T_ATT], "cpu mask biases (shared by reference and override): the first query sees the next key"),
    ("att-causal-diag-mlx", "attention", MLX,
     [("hidden = mx.logical_or(hidden, keys > pos)", "hidden = mx.logical_or(hidden, keys > pos + 1)")],
     [T_MLX], "mlx mask_scores (shared by reference and override): causal mask off by one"),
    ("att-window-off-by-one-cpu", "attention", CPU,
     [("hidden = np.arange(hi)[None, :] <= positions[:, None] - window",
       "hidden = np.arange(hi)[None, :] < positions[:, None] - window")],
     [T_ATT], "cpu mask biases: sliding window one key too wide"),
    ("att-window-bound-cpu", "attention", CPU,
     [("hi = min(s, int(positions.max()) - window + 1)", "hi = min(s, int(positions.max()) - window)")],
     [T_ATT], "cpu mask biases: last hidden column not visited"),
    ("att-window-off-by-one-mlx", "attention", MLX,
     [("hidden = mx.logical_or(hidden, keys <= pos - window)",
       "hidden = mx.logical_or(hidden, keys < pos - window)")],
     [T_MLX, T_ATT], "mlx mask_scores (shared by reference and graph override): window one key too wide"),
    ("att-override-ignores-window", "attention", CPU,
     [("biases = self._biases(positions, s, spec.causal, spec.window)",
       "biases = self._biases(positions, s, spec.causal, None)")],
     [T_ATT], "cpu override ignores the sliding window"),
    ("att-mlx-override-ignores-window", "attention", MLX,
     [("                            scores = self.mask_scores(scores, batch.positions_of(self, b), spec.causal, spec.window)",
       "                            scores = self.mask_scores(scores, batch.positions_of(self, b), spec.causal, None)")],
     [T_MLX], "mlx graph override (CPU) ignores the sliding window"),
    ("att-no-mask-prefill-override", "attention", CPU,
     [("masked = t > 1 or spec.window", "masked = bool(spec.window)")],
     [T_ATT], "cpu override skips masking for prefill chunks"),
    ("att-no-mask-prefill-reference", "attention", BACK,
     [("if t > 1 or spec.window:", "if spec.window:")],
     [T_ATT, T_MOD], "per-head reference skips masking for prefill chunks"),
    # -- positions and the KV cache --------------------------------------------------------------
    ("pos-decode-plus-one", "positions/KV", BATCH,
     [("positions = [p for s, n in zip(self.starts, self.lengths) for p in range(s, s + n)]",
       "positions = [p + (n == 1) for s, n in zip(self.starts, self.lengths) for p in range(s, s + n)]")],
     [T_MOD, T_GEN], "Batch: decode rows at position start + 1 (rope and cache write)"),
    ("rope-decode-plus-one-cpu", "positions/KV", CPU,
     [("c, s = cos[positions][:, None, :], sin[positions][:, None, :]",
       "c, s = cos[positions + (t == 1)][:, None, :], sin[positions + (t == 1)][:, None, :]")],
     [T_MOD, T_GEN], "cpu rope: one-row passes rotated one position too far"),
    ("rope-ignores-positions-cpu", "positions/KV", CPU,
     [("c, s = cos[positions][:, None, :], sin[positions][:, None, :]",
       "c, s = cos[:t][:, None, :], sin[:t][:, None, :]")],
     [T_MOD, T_GEN], "cpu rope: rows at 0..T-1 whatever their positions"),
    ("rope-ignores-positions-mlx", "positions/KV", MLX,
     [("offset=positions)", "offset=0)")],
     [T_MLX], "mlx rope: every row at position 0"),
    ("kv-write-wrong-position", "positions/KV", KV,
     [("self.keys[layer] = ops.scatter_rows(self.keys[layer], batch.row_slots, batch.positions, k)",
       "self.keys[layer] = ops.scatter_rows(self.keys[layer], batch.row_slots, batch.positions + 1, k)")],
     [T_MOD, T_GEN], "prealloc cache: keys written one position late"),
    ("kv-write-wrong-slot", "positions/KV", KV,
     [("self.values[layer] = ops.scatter_rows(self.values[layer], batch.row_slots, batch.positions, v)",
       "self.values[layer] = ops.scatter_rows(self.values[layer], batch.row_slots * 0, batch.positions, v)")],
     [T_GEN, T_MOD], "prealloc cache: every sequence's values written to slot 0"),
    ("kv-read-one-too-few", "positions/KV", BACK,
     [("return store[slot, :length]", "return store[slot, :length - 1]")],
     [T_MOD, T_ATT], "read_rows (numpy and MLX): one row too few"),
    ("kv-release-not-freeing", "positions/KV", KV,
     [("        del self.held[slot]\n", "        pass\n")],
     [T_GEN], "slot release does not free the slot"),
    ("kv-basic-release-keeps-tensors", "positions/KV", KV,
     [("        del self.entries[slot]\n", "        pass\n")],
     [T_GEN, T_MOD], "basic cache: release keeps the slot's tensors"),
    ("kv-reserve-not-growing", "positions/KV", KV,
     [("if capacity > self.capacity or n_slots > self.n_slots or", "if n_slots > self.n_slots or")],
     [T_GEN, T_MOD], "prealloc reserve: capacity never grows once allocated"),
    ("kv-alloc-no-reuse", "positions/KV", KV,
     [("slot = next(i for i in range(len(self.held) + 1) if i not in self.held)",
       "slot = max(self.held, default=-1) + 1")],
     [T_GEN], "slot allocation never reuses a freed slot"),
    ("kv-basic-concat-order", "positions/KV", KV,
     [("keys[layer] = ops.concat_dim0(keys[layer], k_b)", "keys[layer] = ops.concat_dim0(k_b, keys[layer])")],
     [T_GEN, T_MOD], "basic cache: new keys prepended instead of appended"),
    ("batch-row-lens-wrong", "positions/KV", BATCH,
     [("[n for n, k in zip(self.kv_lens, self.lengths) for _ in range(k)]",
       "[n for n, k in zip(self.starts, self.lengths) for _ in range(k)]")],
     [T_GEN, T_MLX], "Batch.row_lens: the cached length before the pass (read by the CUDA kernel)"),
    ("batch-packed-offset", "positions/KV", BATCH,
     [("for v in list(x) + [0] * (w - len(x))]", "for v in [0] + list(x) + [0] * (w - len(x) - 1)]")],
     [T_GEN, T_COMP], "zero_padded (Batch.packed, the paged cache's rows): each list one entry late in its section"),
    ("compiled-next-rows-not-advanced", "positions/KV", STEP,
     [("return logits, cache.keys, cache.values, packed + one_more",
       "return logits, cache.keys, cache.values, packed")],
     [T_COMP], "compiled decode: the next step's positions and lengths carried without the one more"),
    ("compiled-next-rows-never-reused", "positions/KV", STEP,
     [("self._carried = (tuple((slot, position + 1) for slot, position in rows), next_packed)",
       "self._carried = (tuple((slot, position) for slot, position in rows), next_packed)")],
     [T_COMP], "compiled decode: the carried index arrays never match the next step (built on the host every step)"),
    ("paged-decode-rows-every-step", "positions/KV", KV,
     [("if self._decode_rows[0] != tables:", "if True:")],
     [T_COMP], "paged compiled decode: the padded gather rows listed again for every token"),
    ("index-arrays-unpadded", "positions/KV", BATCH,
     [("widths = [max(width or len(x), MIN_INDEX_ENTRIES) for x in lists]", "widths = [width or len(x) for x in lists]")],
     [T_GEN], "index arrays of one row in buffers of 4 bytes (MLX CUDA: host memory)"),
    # -- batching --------------------------------------------------------------------------------
    ("batch-linear-ignores-groups", "batching", CPU,
     [("if groups is None or len(groups) == 1:", "if True:")],
     [T_GEN], "cpu linear multiplies all rows together (gemm for a batch of decode rows)"),
    ("batch-mlx-per-seq-linear-ignored", "batching", MLX,
     [("if self.per_sequence_linear and groups is not None and len(groups) > 1:", "if False:")],
     [T_MLX], "mlx per_sequence_linear=True ignored"),
    ("batch-chunk-boundaries", "batching", LOOP,
     [("n = min(self.prefill_chunk, len(s.prompt) - s.cached)",
       "n = min(self.prefill_chunk, len(s.prompt) - s.cached, max(budget, 1))")],
     [T_GEN], "engine: a waiting sequence's chunk cut to the pass's leftover room"),
    ("batch-head-first-row", "batching", BATCH,
     [("logit_rows = [r1 - 1 for (_, r1), w in zip(self.rows, wanted) if w]",
       "logit_rows = [r0 for (r0, _), w in zip(self.rows, wanted) if w]")],
     [T_GEN, T_MOD], "output head applied to the first row of each sequence"),
    ("batch-logits-for-ignored", "batching", BATCH,
     [("wanted = [True] * len(self.slots) if logits_for is None else list(logits_for)",
       "wanted = [True] * len(self.slots)")],
     [T_GEN, T_MOD], "Batch: logits for mid-prompt chunks too (rows misaligned with the sampler)"),
    ("batch-rows-swapped", "batching", LOOP,
     [("            s.last = (step.tokens, row)\n",
       "            s.last = (step.tokens, len(sampled) - 1 - row)\n")],
     [T_GEN], "engine: each sequence's next input taken from another sequence's logit row"),
    ("batch-read-reversed", "batching", LOOP,
     [("for s, token, logprob in zip(step.seqs, tokens, logprobs):",
       "for s, token, logprob in zip(step.seqs, tokens[::-1], logprobs[::-1]):")],
     [T_GEN], "engine: tokens of a pass handed to the sequences in reverse order"),
    # -- sampling and options --------------------------------------------------------------------
    ("samp-stream-drops-top-p", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""",
       """        params = SamplingParams(temperature, top_k, 1.0, min_p, seed)
        (ids,), stop = self._requests([prompt]""")],
     [T_GEN], "stream drops top_p"),
    ("samp-stream-drops-top-k", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""",
       """        params = SamplingParams(temperature, 0, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""")],
     [T_GEN], "stream drops top_k"),
    ("samp-stream-drops-min-p", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""",
       """        params = SamplingParams(temperature, top_k, top_p, 0.0, seed)
        (ids,), stop = self._requests([prompt]""")],
     [T_GEN], "stream drops min_p"),
    ("samp-stream-drops-temperature", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""",
       """        params = SamplingParams(1.0 if temperature else 0.0, top_k, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""")],
     [T_GEN], "stream replaces a nonzero temperature by 1"),
    ("samp-stream-drops-seed", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        (ids,), stop = self._requests([prompt]""",
       """        params = SamplingParams(temperature, top_k, top_p, min_p, None)
        (ids,), stop = self._requests([prompt]""")],
     [T_GEN], "stream drops the seed"),
    ("samp-batch-drops-options", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        encoded, stop = self._requests(prompts,""",
       """        params = SamplingParams(temperature, 0, 1.0, 0.0, seed)
        encoded, stop = self._requests(prompts,""")],
     [T_GEN, T_MOD, T_MLX], "generate_batch drops top_k, top_p and min_p"),
    ("samp-batch-drops-seed", "sampling", ENG,
     [("""        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        encoded, stop = self._requests(prompts,""",
       """        params = SamplingParams(temperature, top_k, top_p, min_p, None)
        encoded, stop = self._requests(prompts,""")],
     [T_GEN, T_MOD, T_MLX], "generate_batch drops the seed"),
    ("samp-stop-not-checked", "sampling", LOOP,
     [("hits = [i for i in (pending.find(x) for x in s.stop) if i >= 0]", "hits = []")],
     [T_GEN], "stop strings never checked"),
    ("samp-stop-no-holdback", "sampling", LOOP,
     [("keep = 0 if last else max(", "keep = 0 if True else max(")],
     [T_GEN], "text that may start a stop string is streamed instead of held back"),
    ("samp-negative-seed-fixed", "sampling", SAMP,
     [("if self.seed is None or self.seed < 0:", "if self.seed is None:"), ("        return self.seed\n", "        return abs(self.seed)\n")],
     [T_GEN], "negative seed used as |seed| (not random)"),
    ("samp-logprob-wrong-row-numpy", "sampling", SAMP,
     [("logprobs[i] = float(row[tok]) - m", "logprobs[i] = float(logits[0][tok]) - m")],
     [T_GEN, T_MOD], "numpy sampler: logprob read from row 0"),
    ("samp-logprob-wrong-row-mlx", "sampling", SAMP,
     [("chosen = mx.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]",
       "chosen = logprobs_all[0][tokens]")],
     [T_MLX, T_MOD], "mlx sampler: logprob read from row 0"),
    ("samp-mlx-top-k-off-by-one", "sampling", SAMP,
     [("kth = mx.sort(x)[-p.top_k]", "kth = mx.sort(x)[-p.top_k - 1]")],
     [T_MLX, T_GEN], "mlx sampler: top_k keeps k + 1 tokens"),
    ("samp-mlx-top-p-inclusive", "sampling", SAMP,
     [("keep_sorted = before < p.top_p", "keep_sorted = before <= p.top_p + 0.05")],
     [T_MLX, T_GEN], "mlx sampler: top_p keeps tokens past the nucleus"),
    ("samp-mlx-min-p-ignored", "sampling", SAMP,
     [("                if p.min_p > 0:\n                    keep = mx.logical_and(keep, probs >= p.min_p * mx.max(probs))",
       "                if False:\n                    keep = mx.logical_and(keep, probs >= p.min_p * mx.max(probs))")],
     [T_MLX, T_GEN], "mlx sampler ignores min_p"),
    ("samp-mlx-temperature-ignored", "sampling", SAMP,
     [("x = logits[i] / p.temperature", "x = logits[i]")],
     [T_MLX, T_GEN], "mlx sampler ignores the temperature"),
    ("samp-numpy-top-p-off-by-one", "sampling", SAMP,
     [("top[order[: int(np.searchsorted(cum, p.top_p)) + 1]] = True",
       "top[order[: int(np.searchsorted(cum, p.top_p)) + 2]] = True")],
     [T_GEN], "numpy sampler: top_p keeps one token past the nucleus"),
    ("cli-drops-top-p", "options", CLI, [("top_p=args.top_p", "top_p=1.0")], [T_CLI + "::test_generate_sampling_options"],
     "CLI drops --top-p"),
    ("cli-drops-top-k", "options", CLI, [("top_k=args.top_k", "top_k=0")], [T_CLI + "::test_generate_sampling_options"],
     "CLI drops --top-k"),
    ("cli-drops-min-p", "options", CLI, [("min_p=args.min_p", "min_p=0.0")], [T_CLI + "::test_generate_sampling_options"],
     "CLI drops --min-p"),
    ("cli-drops-stop", "options", CLI, [("                stop=args.stop)", "                stop=None)")],
     [T_CLI + "::test_generate_options_reach_the_engine"], "CLI drops --stop"),
    ("cli-drops-kv", "options", CLI, [("kv=args.kv,", "kv='prealloc',")],
     [T_CLI + "::test_generate_options_reach_the_engine"], "CLI drops --kv"),
    ("cli-drops-prefill-chunk", "options", CLI, [("prefill_chunk=args.prefill_chunk,", "prefill_chunk=None,")],
     [T_CLI + "::test_generate_options_reach_the_engine"], "CLI drops --prefill-chunk"),
    # -- model arithmetic and tokenizer ------------------------------------------------------------
    ("model-rms-eps", "model", BACK,
     [("inv = self.rsqrt(self.add_scalar(mean_sq, eps))", "inv = self.rsqrt(self.add_scalar(mean_sq, 1e-5))")],
     [T_MOD], "RMSNorm epsilon 1e-5 instead of the file's 1e-6"),
    ("model-rms-mean-n-1", "model", BACK,
     [("mean_sq = self.scale(self.sum_squares_rows(x), 1.0 / n)", "mean_sq = self.scale(self.sum_squares_rows(x), 1.0 / (n - 1))")],
     [T_MOD], "RMSNorm mean over n - 1"),
    ("model-rope-base", "model", CPU,
     [("inv_freq = 1.0 / (base ** (", "inv_freq = 1.0 / ((base * 1.1) ** (")],
     [T_MOD], "cpu rope: base 10% too large"),
    ("model-rope-base-mlx", "model", MLX,
     [("traditional=traditional, base=base,", "traditional=traditional, base=base * 1.1,")],
     [T_MLX], "mlx rope: base 10% too large"),
    ("model-rope-layout-mlx", "model", MLX,
     [("traditional=traditional, base=base,", "traditional=not traditional, base=base,")],
     [T_MLX], "mlx rope: interleaved and rotate-half swapped"),
    ("model-qk-norm-skipped", "model", QWEN,
     [("        q, k = ops.qk_norm_rope(q, k,", "        k = ops.rope(k, batch.positions, sp.n_kv_heads, a.head_dim, a.rope_base, "
       "traditional=False)\n        q, _ = ops.qk_norm_rope(q, k,")],
     [T_MOD], "qwen3: k norm skipped"),
    ("model-llama-rope-halves", "model", LLAMA,
     [("k = ops.rope(k, batch.positions, sp.n_kv_heads, a.head_dim, a.rope_base, traditional=True)",
       "k = ops.rope(k, batch.positions, sp.n_kv_heads, a.head_dim, a.rope_base, traditional=False)")],
     [T_MOD], "llama: rotate-half RoPE on keys"),
    ("tok-contractions-case", "tokenizer", TOK,
     [('''_CONTRACTIONS_CI = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"''',
       '''_CONTRACTIONS_CI = "(?:'s|'t|'re|'ve|'m|'ll|'d)"''')],
     [T_TOK], "llama3/qwen2 contractions case-sensitive"),
    ("tok-drop-newlines-after-punct", "tokenizer", TOK,
     [(r'''|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|''', r'''|\p{N}| ?[^\s\p{L}\p{N}]+|''')],
     [T_TOK], "qwen2 regex: [\\r\\n]* after punctuation dropped"),
    ("tok-llama-bpe-merges", "tokenizer", TOK,
     [('"llama-bpe": ([_LLAMA3], True),', '"llama-bpe": ([_LLAMA3], False),')],
     [T_TOK], "llama-bpe ignore_merges off"),
    ("tok-bos-not-added", "tokenizer", TOK,
     [('add_bos=typed_value(meta, "tokenizer.ggml.add_bos_token", bool, False, source) and bos is not None,',
       "add_bos=False,")],
     [T_TOK], "BOS not added when the file asks"),
    ("tok-digits-by-two", "tokenizer", TOK,
     [(r'''\p{N}{1,3}''', r'''\p{N}{1,2}''')],
     [T_TOK], "llama3 regex: digits grouped by 2"),
    ("tok-chat-double-bos", "tokenizer", ENG,
     [("return tok.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)",
       "return tok.encode(text, add_special=True, parse_special=True)")],
     [T_GEN, T_TOK], "chat prompt: BOS added again when the template already starts with it"),
    # -- chat template bounds ----------------------------------------------------------------------
    ("chat-no-size-cap-mul", "chat", CHAT,
     [("if size is not None and isinstance(n, int) and size * n > MAX_ITEMS:", "if False:")],
     [T_CHAT], "chat: `*` size cap removed"),
    ("chat-no-size-cap-add", "chat", CHAT,
     [("if a is not None and b is not None and a + b > MAX_ITEMS:", "if False:")],
     [T_CHAT], "chat: `+` size cap removed"),
    ("chat-no-pow-cap", "chat", CHAT,
     [('elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:', 'elif False:')],
     [T_CHAT], "chat: `**` exponent cap removed"),
    ("chat-no-range-cap", "chat", CHAT,
     [("if len(r) > MAX_ITEMS:", "if False:")],
     [T_CHAT], "chat: range cap removed"),
    ("chat-no-step-limit", "chat", CHAT,
     [("if self.steps > MAX_STEPS or (", "if (")],
     [T_CHAT], "chat: step limit removed (time limit left)"),
    ("chat-no-time-limit", "chat", CHAT,
     [("if self.steps > MAX_STEPS or (self.steps % 4096 == 0 and time.monotonic() > self.deadline):",
       "if self.steps > MAX_STEPS:")],
     [T_CHAT], "chat: time limit removed (step limit left)"),
    ("chat-no-output-cap", "chat", CHAT,
     [("if length > MAX_OUTPUT:", "if False:")],
     [T_CHAT], "chat: output cap removed"),
    ("chat-no-recursion-handling", "chat", CHAT,
     [("except RecursionError:", "except ZeroDivisionError:")],
     [T_CHAT], "chat: RecursionError not turned into one line"),
    # -- tracing and pipelining --------------------------------------------------------------------
    ("trace-op-not-counted", "tracing", TRACE,
     [("        self.counts[op] += 1\n", "        self.counts[op] += op != \"rope\"\n")],
     [T_TR], "tracer: rope calls not counted"),
    ("trace-op-not-wrapped", "tracing", BACK,
     [('    "mask_scores",\n', "")],
     [T_TR], "mask_scores left out of the protocol's op list (not wrapped)"),
    ("pipe-wrong-pass-tokens", "tracing", LOOP,
     [("                pieces.append(tokens[row:row + 1])",
       "                pieces.append(ops.index_array(s.out[-1:]) if s.out else tokens[row:row + 1])")],
     [T_MLX, T_MOD], "engine: next decode input from the tokens read so far (two passes old when pipelined)"),
    # -- the server and its scheduler ---------------------------------------------------------------
    ("srv-failed-pass-stops-worker", "server", SCHED,
     [("except Exception as e:  # noqa: BLE001 - one failed pass must not stop the server",
       "except ArithmeticError as e:  # noqa: BLE001 - one failed pass must not stop the server")],
     [T_SRV], "scheduler: a pass that raises ends the worker (every later request 503, /health failing)"),
    ("samp-tiny-temperature-divides", "sampling", SAMP,
     [("return self.temperature < GREEDY_BELOW", "return self.temperature == 0")],
     [T_GEN], "sampling: a temperature of 1e-310 divides the logits (NaN probabilities; MLX: an empty completion)"),
    ("samp-stop-strings-unbounded", "sampling", SAMP,
     [("if len(stop) > MAX_STOP_STRINGS:", "if False:")],
     [T_GEN, T_SRV], "stop strings: any number accepted (each is checked every token, for every sequence's pass)"),
    ("cli-abbreviations-allowed", "cli", CLI,
     [('kwargs.setdefault("allow_abbrev", False)', 'kwargs.setdefault("allow_abbrev", True)')],
     [T_CLI], "CLI: option prefixes match (`--prompt-f x` taken as --prompt-file, `--temperature` as --temp)"),
    ("cli-stop-escapes-kept", "cli", CLI,
     [('metavar="TEXT", type=unescape,', 'metavar="TEXT",')],
     [T_CLI], "CLI: --stop \\n stops at a backslash and an n, not at a newline"),
    ("srv-queue-counts-the-next-batch", "server", SCHED,
     [("room = self.max_queue + max(0, self.max_batch - len(self.running))", "room = self.max_queue")],
     [T_SRV], "scheduler: requests the idle batch is about to take count against max_queue (429 for them)"),
    ("srv-encode-on-the-event-loop", "server", SRV_ROUTES,
     [("return await run_in_threadpool(state.engine.encode_prompt, prompt)", "return state.engine.encode_prompt(prompt)")],
     [T_SRV], "server: prompts rendered and tokenized on the event loop (a long one stalls every client)"),
    ("spec-unread-tensor-ignored", "loading", "mlxinfer/models/spec.py",
     [("    if extra:\n        what = KNOWN_UNSUPPORTED", "    if False:\n        what = KNOWN_UNSUPPORTED")],
     [T_MOD], "loader: a tensor the forward pass does not read (Llama 3's rope_freqs) is ignored: wrong text"),
    ("spec-unread-key-ignored", "loading", "mlxinfer/models/spec.py",
     [("        if name in READ_KEYS or (name in NEUTRAL_KEYS", "        if True or (name in NEUTRAL_KEYS")],
     [T_MOD], "loader: metadata the forward pass does not apply (RoPE scaling) is ignored"),
    ("srv-cancel-keeps-slot", "server", LOOP,
     [("            seq.finish = reason\n            self.cache.release(seq.slot, (seq.prompt + seq.out)[:seq.cached])",
       "            seq.finish = reason")],
     [T_SRV], "scheduler: a cancelled request's KV slot is never released"),
    ("srv-waiting-cancel-stays", "server", SCHED,
     [("            if req in self.waiting:\n                self.waiting.remove(req)", "            if False:")],
     [T_SRV], "scheduler: a cancelled waiting request stays in the queue"),
    ("srv-queue-unbounded", "server", SCHED,
     [("if len(self.waiting) >= room:", "if False:")],
     [T_SRV], "scheduler: max_queue not enforced"),
    ("srv-drops-top-p", "server", SRV_ROUTES,
     [("top_p=float(body.top_p)", "top_p=1.0")],
     [T_SRV], "server drops top_p"),
    ("srv-drops-stop", "server", SRV_ROUTES,
     [("        stop = stop_strings(body.stop)\n", "        stop = stop_strings(body.stop) and []\n")],
     [T_SRV], "server drops stop strings"),
    ("srv-no-body-limit", "server", SRV_BODY,
     [("if len(body) > self.limit:", "if False:"),
      ("if length is not None and (not length.isdigit() or int(length) > self.limit):", "if False:")],
     [T_SRV], "server: no request body size limit"),
    ("paged-parent-not-compared", "positions/KV", BLOCKS,
     [("return bid if block.tokens == tokens and block.parent == parent else None",
       "return bid if block.tokens == tokens else None")],
     [T_GEN], "paged cache: a cached block found by hash and tokens alone (another prefix's block shared)"),
    ("paged-tokens-not-compared", "positions/KV", BLOCKS,
     [("return bid if block.tokens == tokens and block.parent == parent else None",
       "return bid if block.parent == parent else None")],
     [T_GEN], "paged cache: a cached block found by hash and parent alone (a colliding hash shares it)"),
    ("paged-match-whole-prompt", "positions/KV", BLOCKS,
     [("for key, tokens in self._full_blocks(list(prompt)[:len(prompt) - 1]):",
       "for key, tokens in self._full_blocks(list(prompt)):")],
     [T_GEN, T_SRV], "paged cache: a prompt made of cached blocks leaves no token to prefill"),
    ("paged-evict-most-recent", "positions/KV", BLOCKS,
     [("bid = next(iter(self.lru))", "bid = next(reversed(self.lru))")],
     [T_GEN], "paged cache: evicts the most recently used cached block"),
    ("paged-write-wrong-offset", "positions/KV", BLOCKS,
     [("return [table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)]",
       "return [table[p // bs] for p in range(start, start + n)], [(p + 1) % bs for p in range(start, start + n)]")],
     [T_GEN, T_ATT], "paged cache: rows written one offset late within their block"),
    ("srv-budget-ignores-blocks", "server", SCHED,
     [("        if not self.paged:\n            return n_tokens", "        if True:\n            return n_tokens")],
     [T_SRV], "scheduler: the memory budget counts tokens, not the whole blocks the paged cache takes"),
    ("srv-prefix-not-used", "server", LOOP,
     [("seq.cached = seq.cached_tokens = self.cache.match_prefix(slot, seq.prompt)", "pass")],
     [T_SRV], "scheduler never reuses cached prefixes"),
    ("kernel-dot-butterfly-order", "kernels", KERN,
     [("return _butterfly(partial, (16, 8, 4, 2, 1))", "return _butterfly(partial, (1, 2, 4, 8, 16))")],
     [T_KER], "published_dot: butterfly in the other order"),
    ("kernel-softmax-warp-order", "kernels", KERN,
     [("return _butterfly(warp_totals[None, :], (4, 2, 1))[0]", "return _butterfly(warp_totals[None, :], (1, 2, 4))[0]")],
     [T_KER], "published_softmax_total: warp totals combined in the other order"),
    ("kernel-split-on-metal", "kernels", KERN,
     [("return kind in SPLIT_KINDS and (items", "return (items")],
     [T_KER], "launch plan: the split kernels chosen where the source has none (Metal)"),
    ("kernel-split-scratch-unbounded", "kernels", KERN,
     [("items * capacity <= SPLIT_MAX_SCRATCH", "True")],
     [T_KER], "launch plan: every prefill chunk takes the split kernels, whatever their scratch"),
    ("kernel-two-launch-never-for-one-row", "kernels", KERN,
     [("return rows <= TWO_LAUNCH_ROWS or", "return rows < TWO_LAUNCH_ROWS or")],
     [T_KER], "split form: one decode row over a long cache loses the two-launch form"),
    ("kernel-two-launch-bound-doubled", "kernels", KERN,
     [("TWO_LAUNCH_MAX_KEYS = 1 << 14", "TWO_LAUNCH_MAX_KEYS = 1 << 15")],
     [T_KER], "split form: many rows over long caches kept on the two-launch form (its recomputed softmax)"),
    ("kernel-rows-chain-order", "kernels", "metal_kernels/attention.cu",
     [("return ((k & 1) << 4) | ((k & 2) << 2)", "return ((k & 1) << 3) | ((k & 2) << 3)")],
     [T_KER], "kernels by rows: the lane partials joined in another order than the butterfly's"),
    ("kernel-score-tiles-straddle", "kernels", KERN,
     [("tiles = [(t0, min(32, r1 - t0))", "tiles = [(t0, min(32, r1 - r0))")],
     [T_MLX], "kernels by rows: a sequence's last score tile counted from its first row (runs into the next sequence)"),
    ("kernel-one-row-form-spills", "kernels", KERN,
     [('ONE_ROW_LONG_FORM = (("SU", 8), ("KU", 32), ("PF", 1), ("WS", 1))',
       'ONE_ROW_LONG_FORM = (("SU", 8), ("KU", 128), ("PF", 1), ("WS", 1))')],
     [T_KER], "one row over long caches: 2 x 128 values in flight a thread, spilled to local memory"),
    ("kernel-rows-min-raised", "kernels", KERN,
     [("return longest >= ROWS_MIN and capacity", "return longest > ROWS_MIN + 8 and capacity")],
     [T_MLX], "kernels by rows: a 70-row chunk keeps the kernels by key"),
    ("kernel-rows-over-long-caches", "kernels", KERN,
     [("and capacity <= ROWS_MAX_KEYS_PER_ROW * longest", "")],
     [T_MLX], "kernels by rows: a short chunk over a long cache takes them (a thread walks every key)"),
    ("mlx-seq-rows-dropped", "kernels", MLX,
     [("batch.positions,\n                                           batch.row_lens, spec, seq_rows=batch.rows)\n        if isinstance",
       "batch.positions,\n                                           batch.row_lens, spec)\n        if isinstance")],
     [T_MLX], "MLX backend: prefill passes on the prealloc cache never hand the kernels their sequences' rows"),
    ("mlx-long-rows-to-graph-on-cuda", "kernels", MLX,
     [("        if kernels.uses_split(self.kernel, batch.n_rows, spec):\n            return False\n", "")],
     [T_MLX], "MLX backend: one sequence over a long cache sent to the (never compiled) graph path on CUDA"),
    ("mlx-cpu-split-parts-reversed", "model", MLX,
     [("return mx.concatenate(parts, axis=-1)", "return mx.concatenate(parts[::-1], axis=-1)")],
     [T_MLX], "MLX CPU threads: the parts of a cut product put side by side in the wrong order"),
    ("mlx-cpu-threads-ignored-by-rank", "model", MLX,
     [("threads = checked_threads(default_threads(ranks) if threads", "threads = checked_threads(default_threads() if threads")],
     [T_MLX], "MLX CPU threads: a rank of a tp run takes every free core (ranks share them)"),
    ("cpu-threads-ignore-ranks", "model", CPU,
     [("self.threads = set_blas_threads(threads, ranks)", "self.threads = set_blas_threads(threads)")],
     [T_MLX], "cpu backend: a rank of a tp run takes every free core for its BLAS threads"),
    ("load-drops-ranks", "model", ENG,
     [("ops = make_backend(backend, attention, device, kernel, threads, ranks=tp)",
       "ops = make_backend(backend, attention, device, kernel, threads)")],
     [T_TP], "load(tp=N): the backend is not told that N processes share the cores"),
    ("mlx-cpu-heads-part-reads-first-values", "model", MLX,
     [("parts.append(mx.matmul(self.softmax_rows(scores), vh[h0:h1]))", "parts.append(mx.matmul(self.softmax_rows(scores), vh[0:h1 - h0]))")],
     [T_MLX], "MLX CPU threads: every part of the KV heads takes the first heads' values"),
    ("mlx-cpu-streams-not-thread-local", "model", MLX,
     [("_CPU_STREAMS.append(mx.new_thread_local_stream(mx.cpu))", "_CPU_STREAMS.append(mx.new_stream(mx.cpu))")],
     [T_MLX], "MLX CPU threads: plain streams, which fail in the server's worker thread"),
    ("mlx-rms-norm-eps-dropped", "model", MLX,
     [("return mx.fast.rms_norm(x, weight, eps)", "return mx.fast.rms_norm(x, weight, 0.0)")],
     [T_MLX], "MLX backend: the fused RMSNorm drops epsilon"),
    ("mlx-qk-norm-rope-eps-dropped", "model", MLX,
     [("self._rope(mx.fast.rms_norm(xh, weight, eps),", "self._rope(mx.fast.rms_norm(xh, weight, 0.0),")],
     [T_MLX], "MLX backend: qk_norm_rope's RMSNorm (mx.fast path) drops epsilon"),
    ("mlx-qk-norm-rope-norm-after-rope", "model", MLX,
     [("lambda xh: self._rope(mx.fast.rms_norm(xh, weight, eps), positions, head_dim, base, traditional))",
       "lambda xh: mx.fast.rms_norm(self._rope(xh, positions, head_dim, base, traditional), weight, eps))")],
     [T_MLX], "MLX backend: qk_norm_rope (mx.fast path) rotates before it normalizes"),
    ("mlx-qk-norm-rope-keys-take-query-weights", "model", MLX,
     [("self._norm_rope(k, k_weight, positions,", "self._norm_rope(k, q_weight, positions,")],
     [T_MLX], "MLX backend: qk_norm_rope (mx.fast path) normalizes the keys with the queries' weights"),
    ("kernel-header-cut-not-transitive", "kernels", KERN,
     [('            todo |= set(re.findall(r"\\bmlxi_\\w+", defined[n]))\n', "")],
     [T_KER], "kernel sources: a kernel's header keeps the definitions its body names, not what they call"),
    ("kernel-comments-kept", "kernels", KERN,
     [('    body = strip_comments(bodies[name])\n', '    body = bodies[name]\n')],
     [T_KER], "kernel sources: CUDA bodies handed to MLX with their comments (hashed at every launch)"),
    ("kernel-qk-norm-rope-odd-head-dims", "kernels", KERN,
     [("return not traditional and head_dim % 64 == 0", "return not traditional and head_dim % 32 == 0")],
     [T_KER], "qk_norm_rope kernel taken for head dims whose rotated pairs straddle lanes (e.g. 96)"),
    # -- weight groups (Q, K, V and gate, up stacked into one product on MLX) -------------------------
    ("wg-float-view-column-early", "weight groups", MLX,
     [("                yield m[:, start:start + n]", "                yield m[:, max(start - 1, 0):max(start - 1, 0) + n]")],
     [T_WG], "MLX weight group: iterating a float group, K's, V's and up's views start one column early (shapes right)"),
    ("wg-quant-view-scales-early", "weight groups", MLX,
     [("m.scales[start:start + n]", "m.scales[max(start - 1, 0):max(start - 1, 0) + n]")],
     [T_WG], "MLX weight group: iterating a quantized group, K's, V's and up's views take scales one row early"),
    ("wg-group-ignores-sequences", "weight groups", MLX,
     [("y = self.linear(x, ws.merged, groups)", "y = self.linear(x, ws.merged)")],
     [T_WG], "MLX linear_group: the stacked product drops the sequence groups (per_sequence_linear ignored)"),
    ("tp-no-all-sum", "tensor parallel", LAYERS,
     [('return x if shard.size == 1 else ops.all_sum(x, shard.group)', 'return x')],
     [T_TP], "tensor parallel: the row-parallel products' partial sums are never added up"),
    ("tp-heads-not-following-kv", "tensor parallel", SHARD,
     [("heads = (kv[0] * group_size, kv[1] * group_size)", "heads = split(args.n_heads, size)[rank]")],
     [T_TP], "tensor parallel: query heads split on their own, not with their KV heads"),
    ("tp-padding-kept", "tensor parallel", COLL,
     [("return mx.reshape(mx.transpose(parts, (1, 0, 2)), (r, -1))[:, :cols]",
       "return mx.reshape(parts, (r, -1))[:, :cols]")],
     [T_TP], "tensor parallel: gathered logits laid out rank-major, not row by row"),
    ("tp-column-cut-off-by-block", "tensor parallel", GGUF,
     [("return np.ascontiguousarray(full[:, start // block * block_bytes: stop // block * block_bytes])",
       "return np.ascontiguousarray(full[:, start // block * block_bytes + block_bytes: stop // block * block_bytes + block_bytes])")],
     [T_TP], "sharded GGUF view: column blocks read one block late"),
    ("tp-seed-not-agreed", "tensor parallel", LOOP,
     [("seed = self.agree(seed)", "seed = seed")],
     [T_TP], "tensor parallel: each rank draws its own random seed"),
    ("tp-rank1-prints", "tensor parallel", CLI,
     [("        sys.stdout = open(os.devnull, \"w\")\n", "")],
     [T_TP], "generate --tp: every rank prints the text"),
    ("cli-verbose-seed-needs-metrics", "cli", CLI,
     [("    if args.verbose and result.seed is not None:  # (also", "    if args.verbose and not args.quiet and result.seed is not None:  # (also")],
     [T_CLI], "generate --verbose --quiet: the seed not printed"),
    ("auto-backend-ignores-device-gpu", "cli", "mlxinfer/backends/__init__.py",
     [('name = "mlx" if mlx_gpu_available() or device == "gpu" else "cpu"', 'name = "mlx" if mlx_gpu_available() else "cpu"')],
     [T_CLI], "--device gpu with the auto backend: refused as the cpu backend's option"),
    ("model-env-missing-unnamed", "cli", "mlxinfer/model_source.py",
     [("        if not path.is_file():  # said here", "        if False:  # said here")],
     [T_CLI], "MLXINFER_MODEL naming a missing file: the error does not say where the path came from"),
    # -- hardening: hostile files and careless input ----------------------------------------------------
    ("gguf-bool-taken-as-int", "hardening", "mlxinfer/gguf_file.py",
     [("if not (bool in kinds if isinstance(v, bool) else isinstance(v, kinds)):",
       "if not isinstance(v, kinds):")],
     ["tests/test_malformed.py"], "GGUF metadata: a bool accepted where an int belongs (alignment, eos id)"),
    ("gguf-duplicate-key-kept", "hardening", "mlxinfer/gguf_file.py",
     [("            if key in meta:  # llama.cpp", "            if False:  # llama.cpp")],
     ["tests/test_malformed.py"], "GGUF metadata: a duplicate key silently takes the last value"),
    ("gguf-entry-cap-dropped", "hardening", "mlxinfer/gguf_file.py",
     [("            if n > MAX_ENTRIES:", "            if False:")],
     ["tests/test_malformed.py"], "GGUF header: any tensor or key count that fits the file is listed"),
    ("token-ids-truncated", "hardening", TOK,
     [("    bad = next((v for v in values if", "    bad = None and next((v for v in values if")],
     [T_GEN], "token ids: 1.9 becomes 1, True becomes 1"),
    ("surrogate-bare-typeerror", "hardening", TOK,
     [("        except TypeError:  # `tokenizers` takes only", "        except ValueError:  # `tokenizers` takes only")],
     [T_GEN], "text with a lone surrogate: tokenizers' bare TypeError escapes"),
    ("cli-closed-stdout-unchecked", "hardening", CLI,
     [('        if sys.stdout is None and args.command != "serve":', '        if False:')],
     [T_CLI], "generate with stdout closed: a traceback"),
    ("chat-options-checked-per-turn", "hardening", CLI,
     [("        raise RequestError(\"chat reads the conversation from stdin, which is closed\")\n    _check_options(args)\n",
       "        raise RequestError(\"chat reads the conversation from stdin, which is closed\")\n")],
     [T_CLI], "chat --max-tokens 0: refused at every turn, exit status 0"),
    ("threads-unbounded", "hardening", "mlxinfer/backends/cpu.py",
     [("or not 1 <= threads <= limit:", "or not 1 <= threads:")],
     [T_CLI], "--threads 100000 accepted (MLX's CPU device makes a stream per thread)"),
    ("serve-port-unchecked", "hardening", CLI,
     [("    _check_listen(args.host, args.port)  # before", "    pass  # before")],
     [T_SRV], "serve on a port in use: a false 'serving' line, uvicorn's errors and exit status 3"),
    ("server-union-error-first-branch", "hardening", SRV_ERRORS,
     [('first = max(errors, key=lambda x: len(x.get("loc", ())), default={})', 'first = errors[0] if errors else {}')],
     [T_SRV], "a prompt of [3, 1.9]: 'prompt.str: Input should be a valid string'"),
    ("server-text-offset-off-by-one-token", "server", SRV_ROUTES,
     [("    for piece in text[:len(tokens)]:  # each token's text", "    for piece in [''] + text[:len(tokens) - 1]:  # each token's text")],
     [T_SRV], "completions logprobs: text_offset one token late"),
    ("server-disconnect-only-when-idle", "hardening", SRV_ROUTES,
     [("            if clock() >= next_check:", "            if ev is None and clock() >= next_check:"),
      ("timeout=max(0.01, next_check - clock()))", "timeout=0.5)")],
     [T_SRV], "a non-streamed request whose client left runs on while tokens keep arriving"),
    ("server-metrics-cached-as-prefilled", "server", SRV_METRICS,
     [("self.prompt.inc(prompt_tokens - cached_tokens)", "self.prompt.inc(prompt_tokens)")],
     [T_SRV], "/metrics counts the prompt tokens the prefix cache served as prefilled too"),
    # -- mlxinfer bench --------------------------------------------------------------------------------
    ("bench-ratio-across-rounds", "bench", BENCH,
     [('and o.get("round", 1) == p.get("round", 1) and p[key] > 0', 'and p[key] > 0')],
     [T_BENCH], "mlxinfer bench: ours / peer ratios pair rows of different rounds"),
    ("bench-ratio-across-devices", "bench", BENCH,
     [(' and o.get("device") == p.get("device")', '')],
     [T_BENCH], "mlxinfer bench: ours on MLX's CPU compared with mlx-lm on the GPU"),
    ("bench-rounds-same-order", "bench", BENCH,
     [("for part in ((ours, theirs) if rnd % 2 else (theirs, ours)):", "for part in (ours, theirs):")],
     [T_BENCH], "mlxinfer bench --rounds: ours first in every round"),
    ("bench-median-as-mean", "bench", PEERS,
     [('out[k], out[k + "_min"], out[k + "_max"] = statistics.median(values), min(values), max(values)',
       'out[k], out[k + "_min"], out[k + "_max"] = statistics.fmean(values), min(values), max(values)')],
     [T_BENCH], "mlxinfer bench: a row's figure is the mean of its runs, not their median"),
    ("bench-header-without-command", "bench", BENCH,
     [('info = dict(kind="header", command=command, model=model,', 'info = dict(kind="header", model=model,')],
     [T_BENCH], "mlxinfer bench --out: the JSON header does not say which command made the run"),
    # -- issue 28: mlxinfer perplexity -------------------------------------------------------------
    ("ppl-whole-window-scored", "perplexity", PPL,
     [("    return ctx // 2\n", "    return 0\n")],
     [T_PPL], "perplexity: every position of a window scored, not its second half"),
    ("ppl-target-shifted", "perplexity", PPL,
     [("targets = np.asarray(tokens[start + first + 1:start + ctx])",
       "targets = np.asarray(tokens[start + first:start + ctx - 1])")],
     [T_PPL], "perplexity: position j scored against token j instead of j + 1"),
    ("ppl-stderr-over-count", "perplexity", PPL,
     [("math.sqrt(var / (len(nll) - 1))", "math.sqrt(var / len(nll))")],
     [T_PPL], "perplexity: standard error with count instead of count - 1"),
    ("ppl-bos-not-written", "perplexity", PPL,
     [("        if bos_id is not None:\n            w[0] = bos_id\n", "")],
     [T_PPL], "perplexity: windows after the first do not start with BOS where the model adds it"),
    ("ppl-batch-rows-of-first-window", "perplexity", LOOP,
     [("rows[b].append(logits[r0:r1])", "rows[b].append(logits[:r1 - r0])")],
     [T_PPL], "Loop.score_batch: every window of a pass given the first window's logits"),
]


def _copy_tree(root: str) -> str:
    dst = tempfile.mkdtemp(prefix="mlxinfer-mutants-")
    files = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for name in filter(None, files):
        src = os.path.join(root, name)
        bench_script = name.startswith("bench/") and name.count("/") == 1 and name.endswith(".py")
        if os.path.isfile(src) and (bench_script or not name.startswith("bench/")):  # not bench's results
            os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, name))
    return dst


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def run(bug, tree: str) -> dict:
    mid, cls, name, edits, tests, desc = bug
    path = os.path.join(tree, name)
    with open(path, encoding="utf-8") as f:
        original = f.read()
    if any(original.count(old) != 1 for old, _ in edits):
        return dict(id=mid, result="DOES NOT APPLY (the code changed)")
    mutated = original
    for old, new in edits:
        mutated = mutated.replace(old, new)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(mutated)
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *tests],
                           cwd=tree, capture_output=True, text=True, preexec_fn=_limit_memory)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
    failed = [line.split()[1] for line in (r.stdout + r.stderr).splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if r.returncode == 0:
        return dict(id=mid, result="NOT CAUGHT")
    return dict(id=mid, result="CAUGHT", by=failed[0] if failed else f"pytest exit status {r.returncode}")


def main(argv) -> int:
    by_id = {b[0]: b for b in M}
    if argv == ["--list"]:
        for mid, cls, name, _, _, desc in M:
            print(f"{mid:36} {name:28} {desc}")
        return 0
    unknown = [a for a in argv if a not in by_id]
    if unknown:
        print(f"unknown bug(s): {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    tree = _copy_tree(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    missed = 0
    try:
        for mid in argv or list(by_id):
            res = run(by_id[mid], tree)
            missed += res["result"] != "CAUGHT"
            print(json.dumps(res), flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
