"""Random steps for the tests: a mixed batch, its metadata and a paged cache holding the
context K/V (written through pagedattn.write_kv and checked against the numpy writer)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

import pagedattn as pa
import reference as R


@dataclasses.dataclass
class Step:
    """A step over a cache: requests (context_len, num_new_tokens), block table, slots."""

    requests: List[Tuple[int, int]]
    block_size: int
    num_blocks: int
    block_table: np.ndarray  # int32 [num_seqs, max_blocks]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    seq_lens: np.ndarray  # int32 [num_seqs]
    slot_mapping: np.ndarray  # int64 [num_tokens] (-1 for padding rows)
    num_tokens: int  # rows, padding included
    context_slots: List[np.ndarray]  # per request: the slots of its context tokens

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_step(rng: np.random.Generator, requests: Sequence[Tuple[int, int]], block_size: int,
              pad_tokens: int = 0, spare_blocks: int = 3) -> Step:
    """Shuffled physical blocks (block 0 never used), slots from the block table."""
    need = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = 1 + sum(need) + spare_blocks
    perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    width = max(max(need), 1)
    table = np.zeros((len(requests), width), dtype=np.int32)
    slots, ctx_slots, qsl = [], [], [0]
    used = 0
    for r, (c, n) in enumerate(requests):
        table[r, :need[r]] = perm[used:used + need[r]]
        used += need[r]
        pos = np.arange(c + n)
        row_slots = table[r, pos // block_size].astype(np.int64) * block_size + pos % block_size
        ctx_slots.append(row_slots[:c])
        slots.extend(row_slots[c:])
        qsl.append(qsl[-1] + n)
    t_a = qsl[-1]
    slot_mapping = np.array(slots + [-1] * pad_tokens, dtype=np.int64)
    return Step(list(requests), block_size, num_blocks, table, np.array(qsl, dtype=np.int32),
                np.array([c + n for c, n in requests], dtype=np.int32), slot_mapping,
                t_a + pad_tokens, ctx_slots)


def fill_context(rng: np.random.Generator, step: Step, kv_cache: np.ndarray, dtype,
                 kv_cache_dtype: str, k_scale: float, v_scale: float, num_kv_heads: int,
                 head_size: int) -> None:
    """Writes random context K/V for every request through pagedattn.write_kv, and random
    garbage into the rest of the cache first (it must never be read)."""
    if kv_cache.dtype == np.uint8:
        kv_cache[...] = rng.integers(0, 256, kv_cache.shape, dtype=np.uint8) & 0x77  # finite
    else:
        kv_cache[...] = rng.standard_normal(kv_cache.shape).astype(kv_cache.dtype) * 50
    slots = np.concatenate(step.context_slots) if step.context_slots else np.zeros(0, np.int64)
    if len(slots) == 0:
        return
    k = rng.standard_normal((len(slots), num_kv_heads, head_size)).astype(dtype)
    v = rng.standard_normal((len(slots), num_kv_heads, head_size)).astype(dtype)
    pa.write_kv(k, v, slots.astype(np.int64), kv_cache, kv_cache_dtype=kv_cache_dtype,
                k_scale=k_scale, v_scale=v_scale)


def cache_floats(kv_cache: np.ndarray, kv_cache_dtype: str, k_scale: float, v_scale: float):
    """(K values, V values) float64 [NB, bs, Hkv, D] of a combined cache."""
    return (R.cache_values(kv_cache[:, 0], kv_cache_dtype, k_scale),
            R.cache_values(kv_cache[:, 1], kv_cache_dtype, v_scale))


def tolerance(dtype) -> Tuple[float, float]:
    """(atol, rtol) of an output stored in dtype against the float64 reference."""
    return {np.float32: (2e-4, 2e-4), np.float16: (4e-3, 4e-3)}[np.dtype(dtype).type]


def assert_close(got: np.ndarray, ref: np.ndarray, dtype, what: str = "output",
                 scale: Optional[float] = None) -> None:
    atol, rtol = tolerance(dtype)
    if scale is not None:
        atol *= scale
    got64 = got.astype(np.float64)
    err = np.abs(got64 - ref)
    bound = atol + rtol * np.abs(ref)
    bad = ~(err <= bound)
    if bad.any():
        idx = np.argwhere(bad)[0]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off; first at {tuple(idx)}: got "
            f"{got64[tuple(idx)]}, reference {ref[tuple(idx)]} (atol {atol}, rtol {rtol}); "
            f"max error {np.nanmax(err)}")
