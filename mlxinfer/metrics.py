"""The metrics of one generation, and the block the CLI prints after the text (on stderr).

Times are wall-clock, taken where the engine hands a token to the caller:
- time to first token: from the start of the request to its first generated token (the whole
  prefill, chunk by chunk, plus picking the token); prompt tokens/s = prompt tokens / that time;
- decode tokens/s: tokens after the first, over the time between the first and the last token;
- token intervals: the time between consecutive tokens (with a pipelined MLX backend these are what
  a user sees, not the duration of any one pass);
- peak memory: the process's peak so far (peak resident set on the cpu backend, MLX's peak
  allocation on the MLX backend), not this request's alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    backend: str
    kv_cache: str
    attention: str
    prompt_tokens: int = 0
    prefill_chunk: int = 0
    time_to_first_token_ms: float = 0.0
    token_intervals_ms: list[float] = field(default_factory=list)  # between consecutive generated tokens
    finish_reason: str = ""
    peak_memory_mb: float = 0.0
    batch_size: int = 1
    tensor_parallel: int = 1  # ranks the model is split over (peak memory is this rank's)

    @property
    def generated_tokens(self) -> int:
        """Tokens produced (including an end-of-generation token, which is not part of the text)."""
        return len(self.token_intervals_ms) + (1 if self.time_to_first_token_ms else 0)

    @property
    def prompt_tokens_per_second(self) -> float:
        t = self.time_to_first_token_ms
        return 1000.0 * self.prompt_tokens / t if t > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        total = sum(self.token_intervals_ms)
        return 1000.0 * len(self.token_intervals_ms) / total if total > 0 else 0.0

    def format(self) -> str:
        iv = self.token_intervals_ms or [0.0]
        return (
            f"backend: {self.backend}\n"
            f"kv cache: {self.kv_cache}\n"
            f"attention: {self.attention}\n"
            + (f"tensor parallel: {self.tensor_parallel} ranks (peak memory: rank 0's)\n"
               if self.tensor_parallel > 1 else "")
            + "\n"
            "metrics:\n"
            f"  prompt_tokens: {self.prompt_tokens}  (prefill chunk {self.prefill_chunk})\n"
            f"  time_to_first_token_ms: {self.time_to_first_token_ms:.3f}\n"
            f"  prompt_tokens_per_second: {self.prompt_tokens_per_second:.3f}\n"
            f"  generated_tokens: {self.generated_tokens}\n"
            f"  decode_tokens_per_second: {self.decode_tokens_per_second:.3f}\n"
            f"  token_interval_ms: min {min(iv):.3f}  max {max(iv):.3f}  mean {sum(iv) / len(iv):.3f}  "
            f"(n={len(self.token_intervals_ms)})\n"
            f"  finish_reason: {self.finish_reason}\n"
            f"  peak_memory_mb: {self.peak_memory_mb:.1f}"
        )

    def as_dict(self) -> dict:
        iv = self.token_intervals_ms or [0.0]
        return {
            "backend": self.backend,
            "kv_cache": self.kv_cache,
            "attention": self.attention,
            "batch_size": self.batch_size,
            "tensor_parallel": self.tensor_parallel,
            "prompt_tokens": self.prompt_tokens,
            "prefill_chunk": self.prefill_chunk,
            "time_to_first_token_ms": self.time_to_first_token_ms,
            "prompt_tokens_per_second": self.prompt_tokens_per_second,
            "generated_tokens": self.generated_tokens,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "token_interval_ms_min": min(iv),
            "token_interval_ms_max": max(iv),
            "token_interval_ms_mean": sum(iv) / len(iv),
            "finish_reason": self.finish_reason,
            "peak_memory_mb": self.peak_memory_mb,
        }
