"""flash_attn_varlen_func with v of a head size of its own (FlashAttention 3's dv < d, as vLLM's
MLA prefill calls it with Q/K 192 and V 128): packed and paged K/V, bf16 and fp8 caches, on CPU
tensors against the float64 reference. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_TORCH

if not HAS_TORCH:
    pytest.skip("needs torch", allow_module_level=True)

import torch  # noqa: E402

import pagedattn as pa  # noqa: E402
import pagedattn.torch as pt  # noqa: E402
import reference as R  # noqa: E402
from torch_helpers import TOLERANCE, assert_close_torch, cache_values  # noqa: E402


def _padded(v: np.ndarray, d: int) -> np.ndarray:
    """V zero-padded to d columns: the reference's one head size (the padding's output is 0)."""
    pad = np.zeros(v.shape[:-1] + (d - v.shape[-1],))
    return np.concatenate([v, pad], axis=-1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d,dv", [(192, 128), (72, 40)])
def test_packed_kv_with_its_own_v_head_size(causal: bool, d: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(11)
    q_lens, k_lens = [3, 1, 6], [9, 4, 6]
    hq, hk = 4, 2
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    k = torch.randn(sum(k_lens), hk, d, generator=gen)
    v = torch.randn(sum(k_lens), hk, dv, generator=gen)
    cu_q = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + k_lens), dtype=torch.int32)
    out, lse = pt.flash_attn_varlen_func(q, k, v, max(q_lens), cu_q, max(k_lens),
                                         cu_seqlens_k=cu_k, causal=causal,
                                         return_softmax_lse=True)
    assert out.shape == (sum(q_lens), hq, dv)
    kn, vn = k.double().numpy(), _padded(v.double().numpy(), d)
    cuk = cu_k.numpy()
    ref, ref_lse = R.attention_reference(
        q.double().numpy(), cu_q.numpy(), k_lens, d ** -0.5,
        keys_of=lambda r: (kn[cuk[r]:cuk[r + 1]], vn[cuk[r]:cuk[r + 1]]),
        attn_type="decoder" if causal else "encoder_decoder")
    assert_close_torch(out, ref[..., :dv], *TOLERANCE[torch.float32])
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_paged_cache_with_its_own_v_head_size(kv_cache_dtype: str) -> None:
    """Separate key and value caches [num_blocks, block_size, num_kv_heads, d / dv], written by
    reshape_and_cache_flash and read through a block table."""
    gen = torch.Generator().manual_seed(12)
    d, dv, hq, hk, bs, nb = 128, 64, 4, 2, 16, 8
    fp8 = kv_cache_dtype != "auto"
    cache_dt = torch.uint8 if fp8 else torch.bfloat16
    key_cache = torch.zeros(nb, bs, hk, d, dtype=cache_dt)
    value_cache = torch.zeros(nb, bs, hk, dv, dtype=cache_dt)
    seq_lens, q_lens = [40, 7], [1, 7]
    block_table = torch.tensor([[3, 1, 6], [5, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([int(block_table[r, j // bs]) * bs + j % bs
                          for r, s in enumerate(seq_lens) for j in range(s)], dtype=torch.int64)
    n = len(slots)
    k = torch.randn(n, hk, d, generator=gen).bfloat16()
    v = torch.randn(n, hk, dv, generator=gen).bfloat16()
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    pt.reshape_and_cache_flash(k, v, key_cache, value_cache, slots, kv_cache_dtype, k_scale,
                               v_scale)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).bfloat16()
    cu_q = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
    seqused = torch.tensor(seq_lens, dtype=torch.int32)
    out = pt.flash_attn_varlen_func(q, key_cache, value_cache, max(q_lens), cu_q, max(seq_lens),
                                    seqused_k=seqused, block_table=block_table, causal=True,
                                    kv_cache_dtype=kv_cache_dtype, k_descale=k_scale,
                                    v_descale=v_scale)
    assert out.shape == (sum(q_lens), hq, dv) and out.dtype == torch.bfloat16
    kf = cache_values(key_cache, kv_cache_dtype, k_scale)
    vf = _padded(cache_values(value_cache, kv_cache_dtype, v_scale), d)
    ref, _ = R.attention_reference(
        q.double().numpy(), cu_q.numpy(), seq_lens, d ** -0.5,
        keys_of=R.paged_keys(kf, vf, block_table.numpy(), seq_lens))
    assert_close_torch(out, ref[..., :dv], *TOLERANCE[torch.bfloat16])


def test_v_wider_than_q_is_refused() -> None:
    q = torch.randn(2, 2, 32)
    k = torch.randn(2, 2, 32)
    v = torch.randn(2, 2, 48)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(pa.InvalidArgument, match=r"v_head_size \(48\) must be 1..head_size \(32\)"):
        pt.flash_attn_varlen_func(q, k, v, 2, cu, 2, cu_seqlens_k=cu, causal=True)
