"""One global order of training blocks, from the seed and the epoch alone, in constant memory.

`torch.randperm(n)` (what Trainer's RandomSampler draws) holds 8 bytes a block: 4 GB for a trillion tokens in
blocks of 2,048. `GlobalBlockOrder` computes position -> block with a keyed Feistel permutation of [0, n) instead
(four rounds on the smallest even number of bits that covers n, cycle-walking the values past n), so its memory is
a few buffers, not n. The order depends only on (seed, epoch, n): a run of 1 process with batch B and a run of N
processes with batch B / N each read the same blocks at every step (accelerate hands each rank its share of every
global batch), and a resumed run reads, from its step on, what an uninterrupted run would have read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

ROUNDS = 4
CHUNK = 1 << 16  # positions permuted per vectorised call
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's mixing constants


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each value (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A bijection of [0, n) keyed by (seed, epoch); `apply(positions)` maps an int64 array of positions."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError("a permutation needs at least one element")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2  # 2 * half bits cover n: fewer than 4n values, so at most ~4 walks on average
        self.mask = np.uint64((1 << self.half) - 1)
        material = hashlib.sha256(f"kha-order:{seed}:{epoch}".encode()).digest()
        self.keys = [np.uint64(int.from_bytes(material[8 * i : 8 * i + 8], "little")) for i in range(ROUNDS)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << half) | right

    def apply(self, positions: np.ndarray) -> np.ndarray:
        x = self._round_trip(positions.astype(np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():  # cycle-walking: a bijection of [0, 2^bits) restricted to [0, n) stays one
            x[outside] = self._round_trip(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class GlobalBlockOrder(Sampler[int]):
    """Block indices 0..n-1 in the permuted order of epoch `set_epoch(e)` (0 until set), seeded by SEED.

    Trainer calls `set_epoch` at every epoch (transformers >= 5.x reaches the sampler through accelerate's wrappers).
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        permutation = FeistelPermutation(self.n, self.seed, self.epoch)
        for start in range(0, self.n, CHUNK):
            yield from permutation.apply(np.arange(start, min(start + CHUNK, self.n), dtype=np.int64)).tolist()
