"""An independent numpy reference for the tests: float64 attention over a paged cache, the KV
write (with an fp8 encoder that searches the representable values), and the LSE merge.

Written from the specification (spec sections 3.5, 3.8, 4.1-4.6, 4.9, 4.12 and docs/semantics.md),
not from the library: it must not share a bug with it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------
# fp8: every code's value by formula, and round-to-nearest-even by search over the codes.


def _fp8_table(exp_bits: int, man_bits: int, bias: int, ieee_specials: bool) -> np.ndarray:
    values = np.zeros(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> man_bits) & ((1 << exp_bits) - 1)
        man = code & ((1 << man_bits) - 1)
        top = (1 << exp_bits) - 1
        if ieee_specials and exp == top:
            values[code] = sign * np.inf if man == 0 else np.nan
        elif not ieee_specials and exp == top and man == (1 << man_bits) - 1:
            values[code] = np.nan  # e4m3fn: S.1111.111 is NaN, no infinities
        elif exp == 0:
            values[code] = sign * (man / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            values[code] = sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)
    return values


FP8_TABLES = {
    "float8_e4m3fn": _fp8_table(4, 3, 7, ieee_specials=False),
    "float8_e5m2": _fp8_table(5, 2, 15, ieee_specials=True),
}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
CACHE_DTYPE_NAME = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def fp8_decode(codes: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 codes -> float64 values."""
    return FP8_TABLES[dtype][codes.astype(np.int64)]


def fp8_encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> uint8 codes: saturate to the largest finite value, then the nearest
    representable value, ties to the code with an even last bit (a zero result keeps the sign)."""
    table = FP8_TABLES[dtype]
    codes = np.nonzero(np.isfinite(table))[0]
    vals = table[codes]
    flat = np.clip(x.astype(np.float64).reshape(-1), -FP8_MAX[dtype], FP8_MAX[dtype])
    out = np.empty(flat.shape, dtype=np.uint8)
    for start in range(0, flat.size, 4096):
        v = flat[start:start + 4096]
        dist = np.abs(v[:, None] - vals[None, :])
        nearest = dist == dist.min(axis=1, keepdims=True)
        even = nearest & ((codes & 1) == 0)[None, :]
        pick = np.where(even.any(axis=1, keepdims=True), even, nearest)
        chosen = codes[np.argmax(pick, axis=1)]
        zero = table[chosen] == 0  # rounds to zero: keep the sign of the input
        chosen = np.where(zero, np.where(np.signbit(v), 0x80, 0x00), chosen)
        chosen = np.where(np.isnan(v), 0x7F, chosen)
        out[start:start + 4096] = chosen
    return out.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# KV write


def write_kv_reference(
    key: np.ndarray,
    value: np.ndarray,
    slot_mapping: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatters key/value [T, Hkv, D] into caches [NB, bs, Hkv, D] in place (uint8 for fp8)."""
    block_size = key_cache.shape[1]
    fp8 = CACHE_DTYPE_NAME.get(kv_cache_dtype)
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), block_size)
        if fp8:
            key_cache[block, offset] = fp8_encode(
                key[t].astype(np.float32) / np.float32(k_scale), fp8)
            value_cache[block, offset] = fp8_encode(
                value[t].astype(np.float32) / np.float32(v_scale), fp8)
        else:
            key_cache[block, offset] = key[t]
            value_cache[block, offset] = value[t]


def cache_values(cache: np.ndarray, kv_cache_dtype: str, scale: float) -> np.ndarray:
    """The float64 values a cache holds (fp8 bytes decoded and multiplied by the scale)."""
    fp8 = CACHE_DTYPE_NAME.get(kv_cache_dtype)
    if fp8:
        return fp8_decode(cache, fp8) * scale
    return cache.astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Attention


def visible(attn_type: str, a: int, j: np.ndarray, window: Optional[int]) -> np.ndarray:
    """Keys j visible to a query at absolute position a (docs/semantics.md, masks table)."""
    ok = np.ones(j.shape, dtype=bool)
    if attn_type == "decoder":
        ok &= j <= a
    if window is not None:
        if attn_type == "encoder_only":
            ok &= np.abs(j - a) <= window - 1
        else:
            ok &= j >= a - (window - 1)
    return ok


def attention_reference(
    query: np.ndarray,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    *,
    keys_of,
    attn_type: str = "decoder",
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    alibi_slopes: Optional[Sequence[float]] = None,
    sinks: Optional[Sequence[float]] = None,
):
    """float64 attention. ``keys_of(r) -> (K [s_r, Hkv, D], V [s_r, Hkv, D])`` gives request r's
    keys in position order. Returns (out [T_a, Hq, D], lse [Hq, T_a]) for the real tokens."""
    q = query.astype(np.float64)
    num_heads = q.shape[1]
    t_a = int(query_start_loc[len(seq_lens)])
    out = np.zeros((t_a, num_heads, q.shape[2]))
    lse = np.full((num_heads, t_a), -np.inf)
    for r in range(len(seq_lens)):
        begin, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        q_len, s_len = end - begin, int(seq_lens[r])
        if q_len == 0:
            continue
        keys, vals = keys_of(r)
        group = num_heads // keys.shape[1]
        context = s_len - q_len
        j = np.arange(s_len)
        for i in range(q_len):
            a = context + i
            mask = visible(attn_type, a, j, sliding_window)
            for h in range(num_heads):
                x = scale * (keys[:, h // group, :] @ q[begin + i, h])
                if logits_soft_cap:
                    x = logits_soft_cap * np.tanh(x / logits_soft_cap)
                if alibi_slopes is not None:
                    x = x + alibi_slopes[h] * (j - a)
                x = np.where(mask, x, -np.inf)
                m = x.max() if mask.any() else -np.inf
                if sinks is not None:
                    m = max(m, sinks[h])
                if m == -np.inf:
                    continue  # no key and no sink: output 0, lse -inf
                p = np.exp(x - m)
                den = p.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
                out[begin + i, h] = p @ vals[:, h // group, :] / den
                lse[h, begin + i] = m + np.log(den)
    return out, lse


def paged_keys(k_values: np.ndarray, v_values: np.ndarray, block_table: np.ndarray,
               seq_lens: Sequence[int]):
    """keys_of for a paged cache: float caches [NB, bs, Hkv, D], request r's keys follow its
    block-table row."""
    block_size = k_values.shape[1]

    def keys_of(r: int):
        s = int(seq_lens[r])
        pos = np.arange(s)
        blocks = block_table[r, pos // block_size]
        return k_values[blocks, pos % block_size], v_values[blocks, pos % block_size]

    return keys_of


def direct_keys(key: np.ndarray, value: np.ndarray, query_start_loc: Sequence[int]):
    """keys_of for encoder types: request r's keys are its own token rows."""

    def keys_of(r: int):
        b, e = int(query_start_loc[r]), int(query_start_loc[r + 1])
        return key[b:e].astype(np.float64), value[b:e].astype(np.float64)

    return keys_of


# ---------------------------------------------------------------------------------------------
# Merge


def merge_reference(prefix_out, prefix_lse, suffix_out, suffix_lse):
    """spec 4.12 in float64: returns (out [N, H, D], lse [H, N])."""
    p = np.where(np.isinf(prefix_lse), -np.inf, prefix_lse.astype(np.float64))
    s = np.where(np.isinf(suffix_lse), -np.inf, suffix_lse.astype(np.float64))
    m = np.maximum(p, s)
    empty = m == -np.inf
    m_safe = np.where(empty, 0.0, m)
    wp = np.where(empty, 1.0, np.exp(p - m_safe))
    ws = np.where(empty, 0.0, np.exp(s - m_safe))
    total = wp + ws
    po = prefix_out.astype(np.float64)
    so = np.nan_to_num(suffix_out.astype(np.float64))
    wpt = (wp / total).T[:, :, None]
    wst = (ws / total).T[:, :, None]
    out = np.where(wpt == 0, 0.0, wpt * np.nan_to_num(po)) + np.where(wst == 0, 0.0, wst * so)
    out = np.where(empty.T[:, :, None], po, out)
    lse = np.where(empty, -np.inf, np.log(total) + m_safe)
    return out, lse
