"""pagedattn.torch.flash_attn_with_kvcache against a float64 torch computation.

``test_flash_attn_kvcache`` re-expresses FlashAttention's test_flash_attn_kvcache grid (paged
and contiguous caches, cache_batch_idx, cache_leftpad, new k/v appended, rotary, causal, local
windows, ALiBi, GQA/MQA, one and several queries) from FlashAttention's documented semantics,
not from its code. Its tolerance is docs/testing.md's accuracy rule: at most twice the error
of the naive low-precision computation, plus 1e-4. The num_splits axis collapses (a tuning
hint here); head sizes are those every backend serves (64, 128, 256). Points pagedattn cannot
serve (a non-causal window bounded on the right inside the query block; ALiBi on non-causal
blocks of several queries, whose sign convention differs) must raise NotSupported and leave
the cache untouched. The CPU runs a sample of the grid (long caches capped at 2048 tokens);
grid_sampling.py says how to run all of it.
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
import pagedattn.torch as pt  # noqa: E402
from flash_reference import assert_rule as _assert_rule  # noqa: E402
from flash_reference import attention64 as _attention64  # noqa: E402
from flash_reference import rotate64 as _rotate64  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


# --- FlashAttention's test_flash_attn_kvcache grid -----------------------------------------

SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
           (1, 128 * 1024), (16, 128 * 1024), (128, 128)]
KVCACHE_GRID = [p for p in itertools.product(
    SEQLENS,
    [64, 128, 256],  # d
    [False, True],  # has_batch_idx
    [False, True],  # has_leftpad
    [None, 256],  # paged_kv_block_size
    [0.0, 0.5, 1.0],  # rotary_fraction
    [False, True],  # rotary_interleaved
    [True, False],  # seqlen_new_eq_seqlen_q
    [False, True],  # causal
    [False, True],  # local
    [False, True],  # alibi
    [False, True],  # new_kv
    ["mha", "mqa", "gqa"],  # mha_type
    ["float16", "bfloat16"],  # dtype
) if not (  # FlashAttention's own exclusions, and rotary_interleaved without rotary
    (p[0][0] > p[0][1] and p[11]) or (p[5] > 0 and not p[11]) or (p[2] and p[4] is not None)
    or (p[3] and p[4] is not None) or (p[5] == 0 and p[6]))]


def _point_id(p) -> str:
    return "-".join(str(v) for v in p) if isinstance(p, tuple) else str(p)


@pytest.mark.parametrize("index,point",
                         sample_grid(list(enumerate(KVCACHE_GRID)), 40, 400, HAS_CUDA),
                         ids=_point_id)
def test_flash_attn_kvcache(index, point) -> None:
    ((seqlen_q, seqlen_k), d, has_batch_idx, has_leftpad, page, rotary_fraction,
     rotary_interleaved, new_eq, causal, local, alibi, new_kv, mha_type, dtype) = point
    if not HAS_CUDA:
        seqlen_k = min(seqlen_k, 2048)  # the CPU caps the long caches
        if seqlen_q > seqlen_k and new_kv:
            pytest.skip("seqlen_q > seqlen_k with new k/v (FlashAttention skips it)")
    gen = torch.Generator().manual_seed(index)
    tdt = getattr(torch, dtype)
    batch, nheads = 2, 6
    batch_cache = 2 * batch if has_batch_idx else batch
    nheads_k = {"mha": nheads, "mqa": 1, "gqa": 3}[mha_type]
    rotary_dim = math.floor(int(rotary_fraction * d) / 16) * 16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(tdt)

    window = tuple(int(x) for x in torch.randint(0, seqlen_k, (2,), generator=gen)) if local \
        else (-1, -1)
    q = rnd(batch, seqlen_q, nheads, d)  # [b, sq, h, d]
    seqlen_new = seqlen_q if new_eq else int(torch.randint(1, seqlen_q + 1, (1,), generator=gen))
    k_new = rnd(batch, seqlen_new, nheads_k, d) if new_kv else None  # [b, new, hk, d]
    v_new = rnd(batch, seqlen_new, nheads_k, d) if new_kv else None
    if page is None:
        k_cache = rnd(batch_cache, seqlen_k, nheads_k, d)  # [b_cache, sk, hk, d]
        v_cache = rnd(batch_cache, seqlen_k, nheads_k, d)
        block_table, capacity = None, seqlen_k
    else:
        per_seq = math.ceil(seqlen_k / page)
        num_blocks = per_seq * batch * 3
        k_cache = rnd(num_blocks, page, nheads_k, d)  # [NB, page, hk, d]
        v_cache = rnd(num_blocks, page, nheads_k, d)
        block_table = torch.randperm(num_blocks, generator=gen)[:batch * per_seq]
        block_table = block_table.view(batch, per_seq).to(torch.int32)  # [b, per_seq]
        capacity = per_seq * page
    hi = (seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 0 else seqlen_new) + 1
          if new_kv else seqlen_k + 1)
    cache_seqlens = torch.randint(0 if new_kv else 1, hi, (batch,), generator=gen,
                                  dtype=torch.int32)
    leftpad = None
    if has_leftpad:
        leftpad = torch.tensor([int(torch.randint(0, int(s), (1,), generator=gen)) if s > 0 else 0
                                for s in cache_seqlens], dtype=torch.int32)
    batch_idx = (torch.randperm(batch_cache, generator=gen)[:batch].to(torch.int32)
                 if has_batch_idx else None)
    slopes = torch.rand(batch, nheads, generator=gen) * 0.3 if alibi else None
    cos = sin = None
    if rotary_dim > 0:
        angle = torch.rand(capacity if page else seqlen_k, rotary_dim // 2, generator=gen)
        angle = angle * 2 * math.pi
        cos, sin = torch.cos(angle).to(tdt), torch.sin(angle).to(tdt)

    # The expected cache: the rows each request reads, with the new (rotated) keys appended.
    if page is None:
        rows = batch_idx.long() if batch_idx is not None else torch.arange(batch)
        k_rows, v_rows = k_cache[rows].clone(), v_cache[rows].clone()  # [b, capacity, hk, d]
    else:
        bt = block_table.long()
        k_rows = k_cache[bt].flatten(1, 2).clone()
        v_rows = v_cache[bt].flatten(1, 2).clone()
    base = cache_seqlens.long()[:, None]
    per_token = causal or local
    q_ro, k_ro = q, k_new
    if rotary_dim > 0:
        q_pos = (base + torch.arange(seqlen_q)[None, :]) if per_token else base.expand(-1, seqlen_q)
        q_ro = _rotate64(q, cos, sin, q_pos, rotary_interleaved)
        k_ro = _rotate64(k_new, cos, sin, base + torch.arange(seqlen_new)[None, :],
                         rotary_interleaved)
    if new_kv:
        for r in range(batch):
            c = int(cache_seqlens[r])
            k_rows[r, c:c + seqlen_new] = k_ro[r]
            v_rows[r, c:c + seqlen_new] = v_new[r]
    lo = leftpad.tolist() if leftpad is not None else [0] * batch
    hi_k = [int(c) + (seqlen_new if new_kv else 0) for c in cache_seqlens]

    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)
    before = (kc.clone(), vc.clone())
    args = dict(k=dev(k_new), v=dev(v_new), rotary_cos=dev(cos), rotary_sin=dev(sin),
                cache_seqlens=dev(cache_seqlens), cache_batch_idx=dev(batch_idx),
                cache_leftpad=dev(leftpad), block_table=dev(block_table), causal=causal,
                window_size=window, rotary_interleaved=rotary_interleaved,
                alibi_slopes=dev(slopes), num_splits=0, return_softmax_lse=True)
    right = window[1]
    refused = (not causal and local and 0 < right < seqlen_q - 1) or (
        alibi and seqlen_q > 1 and not causal and not (local and right == 0))
    if refused:
        with pytest.raises(pa.NotSupported, match="window_size|alibi"):
            pt.flash_attn_with_kvcache(dev(q), kc, vc, **args)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), "a refusal wrote"
        return
    try:
        out, lse = pt.flash_attn_with_kvcache(dev(q), kc, vc, **args)
    except pa.NotSupported as e:  # a backend without this head size / dtype says why
        if HAS_CUDA and "head_size" in str(e):
            pytest.skip(f"backend refuses: {e}")
        raise
    assert out.shape == (batch, seqlen_q, nheads, d) and out.dtype == tdt
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32

    keys = [k_rows[r, lo[r]:hi_k[r]] for r in range(batch)]
    values = [v_rows[r, lo[r]:hi_k[r]] for r in range(batch)]
    scale = d ** -0.5
    ref, ref_lse = _attention64(q_ro, keys, values, causal, window, 0.0, slopes, scale)
    naive, naive_lse = _attention64(q_ro, keys, values, causal, window, 0.0, slopes, scale, tdt)
    _assert_rule(out, ref, naive, 1e-4, "output")
    lse_atol = max(1e-5, 8 * 2.0 ** -23 * ref_lse[torch.isfinite(ref_lse)].abs().max().item()
                   if torch.isfinite(ref_lse).any() else 1e-5)
    _assert_rule(lse, ref_lse, naive_lse, lse_atol, "lse")

    # The cache: new v stored as given, new k as rotated (one rounding apart at most), every
    # other entry untouched.
    if page is None:
        got_k, got_v = kc.cpu()[rows], vc.cpu()[rows]
        others = torch.ones(batch_cache, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(kc.cpu()[others], before[0].cpu()[others])
    else:
        got_k, got_v = kc.cpu()[bt].flatten(1, 2), vc.cpu()[bt].flatten(1, 2)
    torch.testing.assert_close(got_v, v_rows, atol=0, rtol=0)
    torch.testing.assert_close(got_k.float(), k_rows.float(), atol=1e-3, rtol=2 ** -7)


# --- the rest of the contract ---------------------------------------------------------------


def _small(gen, batch=2, sq=3, h=4, hk=2, d=64, sk=40, dtype=torch.bfloat16):
    q = torch.randn(batch, sq, h, d, generator=gen).to(dtype)
    kc = torch.randn(batch, sk, hk, d, generator=gen).to(dtype)
    vc = torch.randn(batch, sk, hk, d, generator=gen).to(dtype)
    return q, kc, vc


def test_kvcache_uniform_alibi_softcap_int_seqlens() -> None:
    """One ALiBi row for all requests (one call), a soft cap, cache_seqlens as an int, and a
    causal block whose requests have fewer keys than queries (those rows are 0, LSE -inf)."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc = _small(gen, sq=6, sk=40)
    slopes = pa.alibi_slopes(4)
    out, lse = pt.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, causal=True, softcap=20.0,
                                          alibi_slopes=torch.tensor(slopes),
                                          return_softmax_lse=True)
    keys = [kc[r, :4] for r in range(2)]
    vals = [vc[r, :4] for r in range(2)]
    sl = torch.tensor([slopes, slopes])
    ref, ref_lse = _attention64(q, keys, vals, True, (-1, -1), 20.0, sl, 64 ** -0.5)
    naive, naive_lse = _attention64(q, keys, vals, True, (-1, -1), 20.0, sl, 64 ** -0.5,
                                    torch.bfloat16)
    assert (out[:, :2] == 0).all() and torch.isinf(lse[:, :, :2]).all()
    _assert_rule(out, ref, naive, 1e-4, "output")
    _assert_rule(lse, ref_lse, naive_lse, 1e-5, "lse")


def test_kvcache_rows_without_keys() -> None:
    """Not causal, a request with no cached keys and nothing appended: output 0, LSE -inf; the
    other request is attended as usual."""
    gen = torch.Generator().manual_seed(4)
    q, kc, vc = _small(gen, sq=1)
    out, lse = pt.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(
        [0, 9], dtype=torch.int32), return_softmax_lse=True)
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    ref, _ = _attention64(q[1:], [kc[1, :9]], [vc[1, :9]], False, (-1, -1), 0.0, None, 0.125)
    naive, _ = _attention64(q[1:], [kc[1, :9]], [vc[1, :9]], False, (-1, -1), 0.0, None, 0.125,
                            torch.bfloat16)
    _assert_rule(out[1:], ref, naive, 1e-4, "output")


def test_kvcache_fp8_cache() -> None:
    """An fp8 e4m3 cache (keyword extension): the new keys are quantised with k_descale and the
    attention reads them back dequantised."""
    gen = torch.Generator().manual_seed(5)
    q, kc16, vc16 = _small(gen, sq=2)
    ks, vs = 0.02, 0.03
    kc = (kc16.float() / ks).to(torch.float8_e4m3fn)
    vc = (vc16.float() / vs).to(torch.float8_e4m3fn)
    k_new = torch.randn(2, 2, 2, 64, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(2, 2, 2, 64, generator=gen).to(torch.bfloat16)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    out = pt.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                     k_descale=ks, v_descale=vs)
    assert torch.equal(kc[0, 5:7], (k_new[0].float() / ks).to(torch.float8_e4m3fn))
    keys = [kc[r, :int(s) + 2].float() * ks for r, s in enumerate(seqlens)]
    vals = [vc[r, :int(s) + 2].float() * vs for r, s in enumerate(seqlens)]
    ref, _ = _attention64(q, keys, vals, True, (-1, -1), 0.0, None, 0.125)
    naive, _ = _attention64(q, keys, vals, True, (-1, -1), 0.0, None, 0.125, torch.bfloat16)
    _assert_rule(out, ref, naive, 1e-4, "output")


@pytest.mark.parametrize("per_request_alibi", [False, True])
def test_kvcache_fp8_per_head_descales(per_request_alibi) -> None:
    """Per-head descales: [num_kv_heads] k/v descales quantise the new keys head by head and
    read the cache back likewise; [batch, num_kv_heads] ones read request r's head h with
    [r, h] (also when ALiBi rows differ and each request is a call of its own)."""
    gen = torch.Generator().manual_seed(7)
    q, kc16, vc16 = _small(gen, sq=2)
    ks, vs = torch.tensor([0.02, 0.11]), torch.tensor([0.3, 0.015])
    kc = (kc16.float() / ks[:, None]).to(torch.float8_e4m3fn)
    vc = (vc16.float() / vs[:, None]).to(torch.float8_e4m3fn)
    k_new = torch.randn(2, 2, 2, 64, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(2, 2, 2, 64, generator=gen).to(torch.bfloat16)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    slopes = torch.tensor([pa.alibi_slopes(4), [0.5 * x for x in pa.alibi_slopes(4)]])
    kw = dict(alibi_slopes=slopes) if per_request_alibi else {}
    out = pt.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                     k_descale=ks, v_descale=vs, **kw)
    assert torch.equal(kc[0, 5:7], (k_new[0].float() / ks[:, None]).to(torch.float8_e4m3fn))
    sl = slopes if per_request_alibi else None

    def check(out, kd, vd):
        keys = [kc[r, :int(s) + 2].float() * kd[r][:, None] for r, s in enumerate(seqlens)]
        vals = [vc[r, :int(s) + 2].float() * vd[r][:, None] for r, s in enumerate(seqlens)]
        ref, _ = _attention64(q, keys, vals, True, (-1, -1), 0.0, sl, 0.125)
        naive, _ = _attention64(q, keys, vals, True, (-1, -1), 0.0, sl, 0.125, torch.bfloat16)
        _assert_rule(out, ref, naive, 1e-4, "output")

    check(out, ks.expand(2, 2), vs.expand(2, 2))
    # Per request and head (the cache as written; no new keys).
    kd = torch.tensor([[0.02, 0.11], [0.05, 0.07]])
    vd = torch.tensor([[0.3, 0.015], [0.01, 0.2]])
    out = pt.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens + 2, causal=True,
                                     k_descale=kd, v_descale=vd, **kw)
    check(out, kd, vd)


def test_kvcache_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(6)
    q, kc, vc = _small(gen)
    k_new = torch.randn(2, 3, 2, 64, generator=gen).to(torch.bfloat16)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    f = pt.flash_attn_with_kvcache
    with pytest.raises(pa.InvalidArgument, match="q must be"):
        f(q[0], kc, vc)
    with pytest.raises(pa.InvalidArgument, match="head size"):
        f(q[..., :32], kc, vc)
    with pytest.raises(pa.InvalidArgument, match="multiple"):
        f(q[:, :, :3], kc, vc)
    with pytest.raises(pa.InvalidArgument, match="rows for a batch"):
        f(q, kc[:1], vc[:1], cache_seqlens=seq)
    with pytest.raises(pa.InvalidArgument, match="cache_seqlens must be an int32 \\[batch=2\\]"):
        f(q, kc, vc, cache_seqlens=seq[:1])
    with pytest.raises(pa.InvalidArgument, match="cache holds 40 tokens"):
        f(q, kc, vc, k_new, k_new, cache_seqlens=torch.tensor([3, 38], dtype=torch.int32))
    with pytest.raises(pa.InvalidArgument, match="k and v"):
        f(q, kc, vc, k_new, None, cache_seqlens=seq)
    with pytest.raises(pa.InvalidArgument, match="v is torch.float32"):
        f(q, kc, vc, k_new, k_new.float(), cache_seqlens=seq)
    with pytest.raises(pa.InvalidArgument, match="cache_seqlens is required"):
        f(q, kc, vc, k_new, k_new)
    with pytest.raises(pa.InvalidArgument, match="cache_batch_idx must lie"):
        f(q, kc, vc, cache_seqlens=seq, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(pa.InvalidArgument, match="rotate the new k"):
        f(q, kc, vc, cache_seqlens=seq, rotary_cos=torch.ones(40, 8), rotary_sin=torch.ones(40, 8))
    with pytest.raises(pa.InvalidArgument, match="cache_leftpad must lie"):
        f(q, kc, vc, cache_seqlens=seq, cache_leftpad=torch.tensor([4, 0], dtype=torch.int32))
    paged = kc.view(10, 8, 2, 64)
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    with pytest.raises(pa.NotSupported, match="cache_batch_idx and cache_leftpad"):
        f(q, paged, paged, cache_seqlens=seq, block_table=table,
          cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(pa.InvalidArgument, match="block_table must be int32"):
        f(q, paged, paged, cache_seqlens=seq, block_table=table.long())
    with pytest.raises(pa.NotSupported, match="window_size"):
        f(q, kc, vc, cache_seqlens=seq, window_size=(4, 1))
    with pytest.raises(pa.NotSupported, match="alibi"):
        f(q, kc, vc, cache_seqlens=seq, alibi_slopes=[0.1] * 4)
