"""pagedattn.MultiHeadAttention (spec section 6) from Python: float32 on every CPU backend
against a numpy float64 reference, key lengths equal to and other than the query's, 3-D and 4-D
inputs, vLLM's divisibility check and the key-length bound."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn as pa


def _reference(q, k, v, hq, hkv, d, scale):
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    q = q.reshape(b, sq, hq, d).astype(np.float64)
    k = np.repeat(k.reshape(b, skv, hkv, d).astype(np.float64), hq // hkv, axis=2)
    v = np.repeat(v.reshape(b, skv, hkv, d).astype(np.float64), hq // hkv, axis=2)
    logits = np.einsum("bihd,bjhd->bhij", q, k) * scale
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, v).reshape(b, sq, hq * d)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 80), (16, 1, 64)])
@pytest.mark.parametrize("sq,skv", [(21, 21), (1, 30), (17, 1), (40, 9)])
def test_matches_numpy(backend, hq, hkv, d, sq, skv) -> None:
    if backend == "cpu" and not pa.with_cpu_backend:
        pytest.skip("this build has no cpu backend")
    rng = np.random.default_rng(hq * 100 + d + 7 * sq + skv)
    b, scale = 3, d ** -0.5
    q = rng.standard_normal((b, sq, hq * d)).astype(np.float32)
    k = rng.standard_normal((b, skv, hkv * d)).astype(np.float32)
    v = rng.standard_normal((b, skv, hkv * d)).astype(np.float32)
    mha = pa.MultiHeadAttention(hq, d, scale, num_kv_heads=hkv, attn_backend=backend,
                                dtype="float32")
    assert mha.backend_name == backend
    want = _reference(q, k, v, hq, hkv, d, scale)
    got = np.asarray(mha(q, k, v))
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    out = np.full((b, sq, hq, d), np.nan, dtype=np.float32)  # 4-D, poisoned
    mha.forward(q.reshape(b, sq, hq, d), k.reshape(b, skv, hkv, d), v.reshape(b, skv, hkv, d), out)
    np.testing.assert_allclose(out.reshape(b, sq, hq * d), want, rtol=2e-5, atol=2e-5)


def test_rejects_indivisible_heads_and_bad_key_lengths() -> None:
    with pytest.raises(pa.InvalidArgument, match="divisible"):
        pa.MultiHeadAttention(6, 64, 0.125, num_kv_heads=4, dtype="float32")
    mha = pa.MultiHeadAttention(4, 16, 0.25, dtype="float32")
    q = np.ones((1, 3, 64), np.float32)
    # No keys: every row sees none, output 0 (FlashAttention's answer).
    none = np.ones((1, 0, 64), np.float32)
    assert not mha(q, none, none).any()
    with pytest.raises(pa.InvalidArgument, match="key has 5 tokens per batch element and value 4"):
        mha(q, np.ones((1, 5, 64), np.float32), np.ones((1, 4, 64), np.float32))
