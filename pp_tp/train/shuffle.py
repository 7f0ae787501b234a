"""A seeded permutation of range(n) evaluated one index at a time: the shuffled order of an epoch without an
array of n indices, so a loader's memory does not grow with the corpus.

A 4-round Feistel network over the smallest even-bit domain >= n is a bijection on that domain; walking the
cycle until the value falls below n ("cycle walking") makes it a bijection on range(n). The round function is
a keyed BLAKE2 hash, so the order depends on the key (seed, epoch, component) only.
"""

from __future__ import annotations

import hashlib


def _round(key: bytes, r: int, value: int) -> int:
    digest = hashlib.blake2b(value.to_bytes(8, "little"), key=key, digest_size=8, salt=bytes([r]) * 16).digest()
    return int.from_bytes(digest, "little")


def permuted(i: int, n: int, key: str) -> int:
    """Index `i` of a seeded permutation of range(n) (a bijection for every key)."""
    if not 0 <= i < n:
        raise IndexError(f"index {i} outside range({n})")
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half_bits) - 1
    k = hashlib.blake2b(key.encode(), digest_size=32).digest()
    x = i
    while True:
        left, right = x >> half_bits, x & mask
        for r in range(4):
            left, right = right, left ^ (_round(k, r, right) & mask)
        x = (left << half_bits) | right
        if x < n:
            return x
