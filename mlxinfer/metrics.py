"""The metrics block printed after every generation (the book chapter's form)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    backend: str
    kv_cache: str
    attention: str
    prompt_tokens: int = 0
    forward_ms: list[float] = field(default_factory=list)  # first entry: the prefill pass

    @property
    def time_to_first_token_ms(self) -> float:
        return self.forward_ms[0] if self.forward_ms else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.forward_ms[1:]
        return 1000.0 * len(decode) / sum(decode) if decode and sum(decode) > 0 else 0.0

    def format(self) -> str:
        f = self.forward_ms or [0.0]
        return (
            f"backend: {self.backend}\n"
            f"kv cache: {self.kv_cache}\n"
            f"attention: {self.attention}\n"
            "\n"
            "metrics:\n"
            f"  time_to_first_token_ms: {self.time_to_first_token_ms:.3f}\n"
            f"  decode_tokens_per_second: {self.decode_tokens_per_second:.3f}\n"
            f"  per_forward_ms: min {min(f):.3f}  max {max(f):.3f}  mean {sum(f) / len(f):.3f}  "
            f"(n={len(self.forward_ms)})"
        )

    def as_dict(self) -> dict:
        f = self.forward_ms or [0.0]
        return {
            "backend": self.backend,
            "kv_cache": self.kv_cache,
            "attention": self.attention,
            "prompt_tokens": self.prompt_tokens,
            "time_to_first_token_ms": self.time_to_first_token_ms,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "per_forward_ms_min": min(f),
            "per_forward_ms_max": max(f),
            "per_forward_ms_mean": sum(f) / len(f),
            "n_forwards": len(self.forward_ms),
        }
