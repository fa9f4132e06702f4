"""pagedattn.torch.fa2 (FlashAttention 2's signatures) over FlashAttention 2's
test_flash_attn_varlen_causal grid, re-expressed from its documented grid and tolerance, not
from its code.

The grid: head sizes 32..256 (odd ones included), ten (seqlen_q, seqlen_k) pairs and their
swaps (q longer than k), causal with and without a random local window, packed K/V or a paged
cache of 256 / 512-token blocks with a block table, float16 / bfloat16; batch 8, 9 heads; each
request's query and key lengths drawn from [max(1, s - 20), s]. The output must satisfy
max|out - ref| <= 2 * max|naive - ref| + 1e-5 against the float64 reference (ref) and the naive
low-precision twin (naive) of flash_reference.py. The backward part of the upstream test has
no counterpart (pagedattn is inference only; backward raises NotSupported, checked below).

A sample runs on the CPU (pairs scaled to at most 300 tokens), more with a GPU;
PAGEDATTN_FULL_GRIDS=1 runs every point. A refusal counts as xfailed only for a reason this
grid accepts (flash_reference.refused); anything else fails.
"""

from __future__ import annotations

import itertools
import math

import pytest

from conftest import HAS_CUDA, HAS_TORCH
from grid_sampling import sample_grid

if not HAS_TORCH:
    pytest.skip("needs torch", allow_module_level=True)

import torch  # noqa: E402

import pagedattn as pa  # noqa: E402
from flash_reference import assert_rule, cap_lengths, refused, request64  # noqa: E402
from pagedattn.torch import fa2  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

SEQLENS = [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211),
           (108, 256), (256, 512), (1023, 1024)]
VARLEN_CAUSAL_GRID = list(itertools.product(
    SEQLENS,
    [False, True],  # swap_sq_sk
    [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256],  # d
    [False, True],  # local
    [None, 256, 512],  # paged_kv_block_size
    ["float16", "bfloat16"],  # dtype
))


def _lengths(gen, s, batch):
    """FlashAttention's "random" padding: each length uniform in [max(1, s - 20), s]."""
    return [int(x) for x in torch.randint(max(1, s - 20), s + 1, (batch,), generator=gen)]


def _point_id(p) -> str:
    return "-".join(str(v) for v in p) if isinstance(p, tuple) else str(p)


@pytest.mark.parametrize("index,point",
                         sample_grid(list(enumerate(VARLEN_CAUSAL_GRID)), 8, 400, HAS_CUDA,
                                     seed=2),
                         ids=_point_id)
def test_flash_attn_varlen_causal(index, point) -> None:
    (seqlen_q, seqlen_k), swap, d, local, page, dtype = point
    if swap:
        seqlen_q, seqlen_k = seqlen_k, seqlen_q
    if not HAS_CUDA:
        seqlen_q, seqlen_k = cap_lengths(seqlen_q, seqlen_k, 300)
    gen = torch.Generator().manual_seed(index)
    tdt = getattr(torch, dtype)
    batch, nheads = 8, 9
    window = (tuple(int(x) for x in torch.randint(0, seqlen_k, (2,), generator=gen))
              if local else (-1, -1))
    q = torch.randn(batch, seqlen_q, nheads, d, generator=gen).to(tdt)
    if page is None:
        k = torch.randn(batch, seqlen_k, nheads, d, generator=gen).to(tdt)
        v = torch.randn(batch, seqlen_k, nheads, d, generator=gen).to(tdt)
        block_table = None
    else:
        per_seq = math.ceil(seqlen_k / page)
        num_blocks = per_seq * batch * 3
        k_cache = torch.randn(num_blocks, page, nheads, d, generator=gen).to(tdt)
        v_cache = torch.randn(num_blocks, page, nheads, d, generator=gen).to(tdt)
        block_table = torch.randperm(num_blocks, generator=gen)[:batch * per_seq]
        block_table = block_table.view(batch, per_seq).to(torch.int32)
        k = k_cache[block_table.long()].flatten(1, 2)[:, :seqlen_k]  # [b, sk, h, d]
        v = v_cache[block_table.long()].flatten(1, 2)[:, :seqlen_k]
    lq, lk = _lengths(gen, seqlen_q, batch), _lengths(gen, seqlen_k, batch)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    q_unpad = torch.cat([q[r, :lq[r]] for r in range(batch)])
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    if page is None:
        k_in = dev(torch.cat([k[r, :lk[r]] for r in range(batch)]))
        v_in = dev(torch.cat([v[r, :lk[r]] for r in range(batch)]))
    else:
        k_in, v_in = dev(k_cache), dev(v_cache)
    try:
        out = fa2.flash_attn_varlen_func(
            dev(q_unpad), k_in, v_in, dev(cu_q), dev(cu_k), max(lq), max(lk), causal=True,
            window_size=window, block_table=dev(block_table))
    except pa.NotSupported as e:
        refused(e, HAS_CUDA)
    assert out.shape == q_unpad.shape and out.dtype == tdt
    out = out.cpu()
    scale = d ** -0.5
    for r in range(batch):
        args = (dev(q[r, :lq[r]]), dev(k[r, :lk[r]]), dev(v[r, :lk[r]]), True, window, 0.0, None,
                scale)
        ref, _ = request64(*args)
        naive, _ = request64(*args, low_dtype=tdt)
        assert_rule(out[cu_q[r]:cu_q[r + 1]], ref, naive, 1e-5, f"request {r}")


# --- the rest of FlashAttention 2's interface ----------------------------------------------


def _qkv(gen, b=2, sq=5, sk=7, h=4, hk=2, d=64, dtype=torch.bfloat16):
    q = torch.randn(b, sq, h, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=gen).to(dtype)
    return q, k, v


def _batched_ref(q, k, v, causal, window, low=None):
    outs = [request64(q[r], k[r], v[r], causal, window, 0.0, None, q.shape[-1] ** -0.5, low)[0]
            for r in range(q.shape[0])]
    return torch.stack(outs)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (2, 0)),
                                           (False, (3, 1)), (False, (0, 0)), (False, (2, -1))])
def test_flash_attn_func_and_packed(causal, window) -> None:
    """flash_attn_func through the varlen path; windows bounded on the right (non-causal)
    through virtual requests; the kv- and qkv-packed forms give the same output."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(gen)
    out = fa2.flash_attn_func(q, k, v, causal=causal, window_size=window)
    ref = _batched_ref(q, k, v, causal, window)
    naive = _batched_ref(q, k, v, causal, window, torch.bfloat16)
    assert_rule(out, ref, naive, 1e-5, "flash_attn_func")
    kv = torch.stack((k, v), dim=2)
    assert torch.equal(fa2.flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window),
                       out)
    qs, ks, vs = _qkv(gen, sk=5, hk=4)
    qkv = torch.stack((qs, ks, vs), dim=2)
    got = fa2.flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window)
    assert torch.equal(got, fa2.flash_attn_func(qs, ks, vs, causal=causal, window_size=window))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    varlen = fa2.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 5, causal=causal,
                                                  window_size=window)
    assert torch.equal(varlen, got.flatten(0, 1))
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32)
    varlen_kv = fa2.flash_attn_varlen_kvpacked_func(q.flatten(0, 1), kv.flatten(0, 1), cu, cu_k,
                                                    5, 7, causal=causal, window_size=window)
    assert torch.equal(varlen_kv, out.flatten(0, 1))


def test_fa2_refusals() -> None:
    """Dropout, attention probabilities and gradients are refused with their reasons."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(gen)
    with pytest.raises(pa.NotSupported, match="dropout_p"):
        fa2.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(pa.NotSupported, match="return_attn_probs"):
        fa2.flash_attn_func(q, k, v, return_attn_probs=True)
    qg = q.clone().requires_grad_()
    out = fa2.flash_attn_func(qg, k, v, causal=True)  # the forward pass is served
    with pytest.raises(pa.NotSupported, match="gradients"):
        out.sum().backward()
    assert fa2.flash_attn_with_kvcache is pa.torch.flash_attn_with_kvcache
