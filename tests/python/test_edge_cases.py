"""FlashAttention's edge cases through the torch drop-ins (requests with no keys, a causal query
longer than its keys, empty batches) against the float64 numpy reference, and the layers'
stream argument. The cuda backend refuses a decoder query longer than its keys (NotSupported)
where its plan reads the lengths on the host (the host mirrors cu_seqlens_q_cpu /
seqused_k_cpu); without them its kernels run such rows, and the result is held to the
reference like any other. flash_attn_with_kvcache leaves the rows that see no key out of the
call, so it serves them on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_CUDA, HAS_TORCH

import pagedattn as pa
import reference as R


def test_every_layer_takes_a_stream_argument() -> None:
    """The C++ layers' forward takes `stream` last (0: the legacy default stream; host arrays
    ignore it)."""
    rng = np.random.default_rng(5)
    hq, d = 2, 16
    mha = pa.MultiHeadAttention(hq, d, d ** -0.5, attn_backend="ref", dtype="float32")
    q = rng.standard_normal((1, 3, hq * d)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(mha(q, q, q, stream=0)), np.asarray(mha(q, q, q)))
    ctx = pa.ForwardContext()
    layer = pa.Attention(ctx, hq, d, d ** -0.5, prefix="l.0", dtype="float32",
                         attn_backend="ref", cache_config=pa.CacheConfig(block_size=4))
    layer.bind_kv_cache(pa.allocate_kv_cache(layer.config, 2))
    md = pa.MetadataBuilder(4).add(0, 3, [1]).build().metadata()
    x = rng.standard_normal((3, hq * d)).astype(np.float32)
    with pa.step(ctx, md):
        a = np.asarray(layer(x, x, x, stream=0))
        b = np.asarray(layer.forward(x, x, x, None, None, 0))
    np.testing.assert_array_equal(a, b)


if HAS_TORCH:
    import torch

    import pagedattn.torch as pt
    from torch_helpers import TOLERANCE, assert_close_torch

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sinks", [False, True])
def test_varlen_zero_keys_and_queries_longer_than_keys(device: str, sinks: bool) -> None:
    """Packed K/V, causal: request 0 has more queries than keys (its first rows see none),
    request 1 no keys at all, request 2 a plain prefill. Output 0 and LSE -inf (the sink with
    sinks) for rows that see no key, as FlashAttention answers."""
    gen = torch.Generator().manual_seed(9)
    q_lens, k_lens = [6, 2, 3], [4, 0, 3]
    hq, hk, d = 4, 2, 32
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device)
    k = torch.randn(sum(k_lens), hk, d, generator=gen).to(device)
    v = torch.randn(sum(k_lens), hk, d, generator=gen).to(device)
    s_aux = [-1.0, 0.5, 2.0, 0.0] if sinks else None
    cu_q = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.cumsum([0] + k_lens), dtype=torch.int32, device=device)
    call = lambda: pt.flash_attn_varlen_func(  # noqa: E731
        q, k, v, max(q_lens), cu_q, max(k_lens), cu_seqlens_k=cu_k, causal=True, s_aux=s_aux,
        return_softmax_lse=True)
    try:
        out, lse = call()
    except pa.NotSupported as e:
        # The cuda backend refuses such rows where its plan sees the lengths on the host.
        assert device == "cuda" and "see no key" in str(e), str(e)
        return
    kn, vn = k.double().cpu().numpy(), v.double().cpu().numpy()
    cuk = cu_k.cpu().numpy()
    ref, ref_lse = R.attention_reference(
        q.double().cpu().numpy(), cu_q.cpu().numpy(), k_lens, d ** -0.5,
        keys_of=lambda r: (kn[cuk[r]:cuk[r + 1]], vn[cuk[r]:cuk[r + 1]]), sinks=s_aux)
    assert_close_torch(out, ref, *TOLERANCE[torch.float32])
    got_lse = lse.cpu().numpy()
    assert np.array_equal(np.isinf(got_lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert (out[:2].cpu() == 0).all() and (out[6:8].cpu() == 0).all()  # rows with no key


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_varlen_empty_batch(device: str) -> None:
    hq, d = 4, 32
    q = torch.empty(0, hq, d, device=device)
    k = torch.empty(0, hq, d, device=device)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    out = pt.flash_attn_varlen_func(q, k, k, 0, cu, 0, cu_seqlens_k=cu, causal=True)
    assert out.shape == (0, hq, d)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_zero_keys_and_queries_longer_than_keys(device: str) -> None:
    """flash_attn_with_kvcache, causal, three queries per request over 2 and 0 cached keys."""
    gen = torch.Generator().manual_seed(11)
    batch, seqlen_q, capacity, hq, hk, d = 2, 3, 8, 4, 2, 32
    q = torch.randn(batch, seqlen_q, hq, d, generator=gen).to(device)
    k_cache = torch.randn(batch, capacity, hk, d, generator=gen).to(device)
    v_cache = torch.randn(batch, capacity, hk, d, generator=gen).to(device)
    seqlens = torch.tensor([2, 0], dtype=torch.int32, device=device)
    out, lse = pt.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                          return_softmax_lse=True)
    kn, vn = k_cache.double().cpu().numpy(), v_cache.double().cpu().numpy()
    ref, ref_lse = R.attention_reference(
        q.reshape(-1, hq, d).double().cpu().numpy(), [0, 3, 6], [2, 0], d ** -0.5,
        keys_of=lambda r: (kn[r, :[2, 0][r]], vn[r, :[2, 0][r]]))
    assert_close_torch(out.reshape(-1, hq, d), ref, *TOLERANCE[torch.float32])
    got_lse = lse.transpose(0, 1).reshape(hq, -1).cpu().numpy()  # [B, H, S] -> [H, B * S]
    assert np.array_equal(np.isinf(got_lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
