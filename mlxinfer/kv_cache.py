"""The KV cache: the keys and values of every position seen so far, per layer.

`BasicKVCache` is the book's basic cache: each step appends its rows with `concat_dim0`, which rebuilds
the whole tensor (O(S) copy per layer per token). A preallocated cache is a later chapter.
"""

from __future__ import annotations


class BasicKVCache:
    name = "basic"

    def __init__(self, ops, n_layers: int):
        self.ops = ops
        self.keys = [None] * n_layers
        self.values = [None] * n_layers
        self.offset = 0  # positions already cached (before the rows being processed now)

    def update(self, layer: int, k, v):
        """Append this step's [T, KV*D] keys and values; return the full [S, KV*D] tensors."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = self.ops.concat_dim0(self.keys[layer], k)
            self.values[layer] = self.ops.concat_dim0(self.values[layer], v)
        return self.keys[layer], self.values[layer]

    def advance(self, n: int) -> None:
        self.offset += n
