"""pagedattn.MultiHeadAttention (spec section 6) from Python: float32 on every CPU backend
against a numpy float64 reference, 3-D and 4-D inputs, and vLLM's divisibility check."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn as pa


def _reference(q, k, v, hq, hkv, d, scale):
    b, s = q.shape[0], q.shape[1]
    q = q.reshape(b, s, hq, d).astype(np.float64)
    k = np.repeat(k.reshape(b, s, hkv, d).astype(np.float64), hq // hkv, axis=2)
    v = np.repeat(v.reshape(b, s, hkv, d).astype(np.float64), hq // hkv, axis=2)
    logits = np.einsum("bihd,bjhd->bhij", q, k) * scale
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, v).reshape(b, s, hq * d)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 80), (16, 1, 64)])
def test_matches_numpy(backend, hq, hkv, d) -> None:
    if backend == "cpu" and not pa.with_cpu_backend:
        pytest.skip("this build has no cpu backend")
    rng = np.random.default_rng(hq * 100 + d)
    b, s, scale = 3, 21, d ** -0.5
    q = rng.standard_normal((b, s, hq * d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv * d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv * d)).astype(np.float32)
    mha = pa.MultiHeadAttention(hq, d, scale, num_kv_heads=hkv, attn_backend=backend,
                                dtype="float32")
    assert mha.backend_name == backend
    want = _reference(q, k, v, hq, hkv, d, scale)
    got = np.asarray(mha(q, k, v))
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    out = np.full((b, s, hq, d), np.nan, dtype=np.float32)  # 4-D, poisoned
    mha.forward(q.reshape(b, s, hq, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d), out)
    np.testing.assert_allclose(out.reshape(b, s, hq * d), want, rtol=2e-5, atol=2e-5)


def test_rejects_indivisible_heads_and_other_key_lengths() -> None:
    with pytest.raises(pa.InvalidArgument, match="divisible"):
        pa.MultiHeadAttention(6, 64, 0.125, num_kv_heads=4, dtype="float32")
    mha = pa.MultiHeadAttention(4, 16, 0.25, dtype="float32")
    q = np.zeros((1, 3, 64), np.float32)
    kv = np.zeros((1, 5, 64), np.float32)
    with pytest.raises(pa.NotSupported, match="Skv=5"):
        mha(q, kv, kv)
