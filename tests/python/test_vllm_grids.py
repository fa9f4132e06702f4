"""vLLM's kernel test grids (spec section 10), re-expressed against pagedattn.torch.

Written from the spec's descriptions of the grids and tolerances, not from vLLM's code:

* ``test_varlen_with_paged_kv``: test_flash_attn.py::test_varlen_with_paged_kv.
* ``test_flash_attn_with_paged_kv``: test_flash_attn.py::test_flash_attn_with_paged_kv (decode
  through flash_attn_with_kvcache with vLLM's fork keywords; sampled, grid_sampling.py).
* ``test_reshape_and_cache_flash``: test_cache.py::test_reshape_and_cache_flash.
* ``test_merge_attn_states``: test_merge_attn_states.py::test_merge_attn_states.
* ``test_causal_backend_correctness`` / ``test_sliding_window_backend_correctness``: the batch
  specs of tests/v1/attention/test_attention_backends.py through the Attention module (the
  full metadata-builder + write + attention path).

Grid axes that have no counterpart here are collapsed, not skipped: vLLM's FA version axis
{2, 3} (pagedattn has one implementation), the reshape test's implementation axis
{cuda, triton}. Everything must pass (fp8 queries included: with q_dtype e4m3 the query and
both caches are e4m3 with unit descales, as in vLLM's test, and the reference reads their
values).

The grids need a GPU (they run on CUDA only, since their shapes are sized for one);
``PAGEDATTN_GRIDS_ON_CPU=1`` runs them on the CPU backend through torch CPU tensors instead
(slow: for checking the tests themselves).
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest

from conftest import HAS_CUDA, HAS_TORCH
from grid_sampling import sample_grid

ON_CPU = os.environ.get("PAGEDATTN_GRIDS_ON_CPU") == "1"
if not HAS_TORCH:
    pytest.skip("needs torch", allow_module_level=True)
if not (HAS_CUDA or ON_CPU):
    pytest.skip("vLLM grids need a CUDA device (or PAGEDATTN_GRIDS_ON_CPU=1)",
                allow_module_level=True)

import torch  # noqa: E402

import pagedattn as pa  # noqa: E402
import pagedattn.torch as pt  # noqa: E402
import reference as R  # noqa: E402
from torch_helpers import assert_close_torch  # noqa: E402

DEVICE = "cuda" if HAS_CUDA and not ON_CPU else "cpu"


def _gathered_keys(key_cache, value_cache, block_table, seq_lens):
    """keys_of for the numpy reference that gathers one request's keys on the device (the
    caches of these grids are too large to copy to the host whole)."""
    bs = key_cache.shape[1]

    def keys_of(r):
        n = int(seq_lens[r])
        pos = torch.arange(n, device=key_cache.device)
        blocks = block_table[r, pos // bs].long()
        k = key_cache[blocks, pos % bs].double().cpu().numpy()
        v = value_cache[blocks, pos % bs].double().cpu().numpy()
        return k, v

    return keys_of


# --- test_flash_attn.py::test_varlen_with_paged_kv -----------------------------------------

VARLEN_SEQ_LENS = [[(1, 1328), (5, 18), (129, 463)], [(1, 523), (1, 37), (1, 2011)]]
VARLEN_GRID = list(itertools.product(
    range(len(VARLEN_SEQ_LENS)),  # seq_lens
    [(4, 4), (8, 2)],  # (num_query_heads, num_kv_heads)
    [128, 256],  # head_size
    [32768, 2048],  # num_blocks
    [None, 256],  # sliding_window
    [None, 50.0],  # soft_cap
    ["float16", "bfloat16"],  # dtype
    [True, False],  # use_out
    [None, "fp8_e4m3"],  # q_dtype
))


@pytest.mark.parametrize(
    "seqs,heads,head_size,num_blocks,window,soft_cap,dtype,use_out,q_dtype", VARLEN_GRID,
    ids=lambda v: str(v))
def test_varlen_with_paged_kv(seqs, heads, head_size, num_blocks, window, soft_cap, dtype,
                              use_out, q_dtype) -> None:
    torch.manual_seed(0)
    seq_lens = VARLEN_SEQ_LENS[seqs]
    hq, hk = heads
    block_size = 16
    if ON_CPU:
        num_blocks = min(num_blocks, 512)
    tdt = getattr(torch, dtype)
    q_lens = [q for q, _ in seq_lens]
    kv_lens = [k for _, k in seq_lens]
    query = torch.randn(sum(q_lens), hq, head_size, dtype=tdt, device=DEVICE)
    key_cache = torch.randn(num_blocks, block_size, hk, head_size, dtype=tdt, device=DEVICE)
    value_cache = torch.randn_like(key_cache)
    cu_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32,
                        device=DEVICE)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    max_blocks = math.ceil(max(kv_lens) / block_size)
    block_table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), dtype=torch.int32,
                                device=DEVICE)
    scale = head_size ** -0.5
    window_size = (window - 1, 0) if window is not None else (-1, -1)
    out = torch.empty_like(query) if use_out else None
    descale = {}
    if q_dtype is not None:  # fp8 query and cache, unit descales; the reference reads them
        e4m3 = torch.float8_e4m3fn
        query, key_cache, value_cache = (t.to(e4m3) for t in (query, key_cache, value_cache))
        ones = torch.ones(len(seq_lens), hk, device=DEVICE)
        descale = dict(q_descale=ones, k_descale=ones, v_descale=ones)
    got = pt.flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, cu_seqlens_q=cu_q, seqused_k=kv_lens_t,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens), softmax_scale=scale, causal=True,
        window_size=window_size, block_table=block_table, softcap=soft_cap or 0.0, out=out,
        **descale)
    if use_out:
        assert got is out
    elif q_dtype is not None:
        got = got.to(tdt)  # FA3 returns bf16 for an fp8 query
    ref, _ = R.attention_reference(
        query.double().cpu().numpy(), cu_q.cpu().numpy(), kv_lens, scale,
        keys_of=_gathered_keys(key_cache, value_cache, block_table, kv_lens),
        sliding_window=window, logits_soft_cap=soft_cap)
    assert_close_torch(got, ref, atol=1.5e-2, rtol=1e-2)


# --- test_flash_attn.py::test_flash_attn_with_paged_kv ------------------------------------
# Decode (one query per request) through flash_attn_with_kvcache with vLLM's fork keywords
# (out, fa_version, q/k/v descales [num_seqs, num_kv_heads]). Sampled (grid_sampling).

PAGED_KV_GRID = [p for p in itertools.product(
    [True, False],  # use_out
    [(1328, 18, 463), (1, 54, 293, 70)],  # kv_lens
    [(4, 4), (8, 2), (16, 2)],  # (num_query_heads, num_kv_heads)
    [128, 256],  # head_size
    [16, 32],  # block_size
    ["float16", "bfloat16"],  # dtype
    [None, 10.0, 50.0],  # soft_cap
    [32768, 2048],  # num_blocks
    [None, 256],  # sliding_window
    [None, "fp8_e4m3"],  # q_dtype (vLLM: bfloat16 only)
) if not (p[9] is not None and p[5] != "bfloat16")]


@pytest.mark.parametrize(
    "use_out,kv_lens,heads,head_size,block_size,dtype,soft_cap,num_blocks,window,q_dtype",
    sample_grid(PAGED_KV_GRID, 12, 400, HAS_CUDA and not ON_CPU, seed=4), ids=lambda v: str(v))
def test_flash_attn_with_paged_kv(use_out, kv_lens, heads, head_size, block_size, dtype,
                                  soft_cap, num_blocks, window, q_dtype) -> None:
    torch.manual_seed(0)
    hq, hk = heads
    if ON_CPU:
        num_blocks = min(num_blocks, 512)
    tdt = getattr(torch, dtype)
    num_seqs = len(kv_lens)
    query = torch.randn(num_seqs, hq, head_size, dtype=tdt, device=DEVICE)
    key_cache = torch.randn(num_blocks, block_size, hk, head_size, dtype=tdt, device=DEVICE)
    value_cache = torch.randn_like(key_cache)
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    max_blocks = math.ceil(max(kv_lens) / block_size)
    block_table = torch.randint(0, num_blocks, (num_seqs, max_blocks), dtype=torch.int32,
                                device=DEVICE)
    scale = head_size ** -0.5
    window_size = (window - 1, 0) if window is not None else (-1, -1)
    q = query.unsqueeze(1)  # [num_seqs, 1, hq, d]
    out = torch.empty_like(q) if use_out else None
    descale = {}
    if q_dtype is not None:  # fp8 query and caches, unit descales; the reference reads them
        e4m3 = torch.float8_e4m3fn
        q, key_cache, value_cache = (t.to(e4m3) for t in (q, key_cache, value_cache))
        ones = torch.ones(num_seqs, hk, device=DEVICE)
        descale = dict(q_descale=ones, k_descale=ones, v_descale=ones)
    got = pt.flash_attn_with_kvcache(
        q=q, k_cache=key_cache, v_cache=value_cache, out=out, softmax_scale=scale, causal=True,
        block_table=block_table, cache_seqlens=kv_lens_t, softcap=soft_cap or 0.0,
        window_size=window_size, fa_version=3, **descale)
    if use_out:
        assert got is out
    got = got.squeeze(1)
    cu_q = np.arange(num_seqs + 1, dtype=np.int32)
    ref, _ = R.attention_reference(
        q.squeeze(1).double().cpu().numpy(), cu_q, list(kv_lens), scale,
        keys_of=_gathered_keys(key_cache, value_cache, block_table, kv_lens),
        sliding_window=window, logits_soft_cap=soft_cap)
    atol, rtol = (1.5e-1, 1.5e-1) if q_dtype is not None else (1.5e-2, 1e-2)
    assert_close_torch(got, ref, atol=atol, rtol=rtol)


# --- test_cache.py::test_reshape_and_cache_flash -------------------------------------------

CACHE_GRID = list(itertools.product(
    [21],  # num_tokens
    [8],  # num_heads
    [64, 80, 256],  # head_size
    [8, 16, 32],  # block_size
    [1024, 10000],  # num_blocks
    ["bfloat16", "float32"],  # dtype
    ["auto", "fp8"],  # kv_cache_dtype
    ["NHD", "HND"],  # kv_cache_layout
))


@pytest.mark.parametrize(
    "num_tokens,num_heads,head_size,block_size,num_blocks,dtype,kv_cache_dtype,layout",
    CACHE_GRID, ids=lambda v: str(v))
def test_reshape_and_cache_flash(num_tokens, num_heads, head_size, block_size, num_blocks, dtype,
                                 kv_cache_dtype, layout) -> None:
    torch.manual_seed(0)
    if ON_CPU:
        num_blocks = min(num_blocks, 256)
    tdt = getattr(torch, dtype)
    fp8 = kv_cache_dtype != "auto"
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].long()
    key = torch.randn(num_tokens, num_heads, head_size, dtype=tdt, device=DEVICE)
    value = torch.randn_like(key)
    # vLLM's FlashAttention layout [2, num_blocks, ...] (K and V halves of one allocation);
    # HND stores [.., num_heads, block_size, ..] and is seen through strides.
    cache_dt = torch.uint8 if fp8 else tdt
    if layout == "NHD":
        kv = torch.zeros(2, num_blocks, block_size, num_heads, head_size, dtype=cache_dt,
                         device=DEVICE)
    else:
        kv = torch.zeros(2, num_blocks, num_heads, block_size, head_size, dtype=cache_dt,
                         device=DEVICE).permute(0, 1, 3, 2, 4)
    key_cache, value_cache = kv.unbind(0)
    k_scale = (key.float().abs().amax() / 64.0).to(torch.float32).reshape(1)
    v_scale = (value.float().abs().amax() / 64.0).to(torch.float32).reshape(1)
    pt.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, kv_cache_dtype,
                               k_scale, v_scale)
    ks, vs = (float(k_scale), float(v_scale)) if fp8 else (1.0, 1.0)
    blocks, offsets = slots // block_size, slots % block_size
    got_k, got_v = key_cache[blocks, offsets].cpu(), value_cache[blocks, offsets].cpu()
    if fp8:
        # Bytes equal to the reference encoder's; and vLLM's check after dequantisation.
        want_k = R.fp8_encode(key.float().cpu().numpy() / np.float32(ks), "float8_e4m3fn")
        want_v = R.fp8_encode(value.float().cpu().numpy() / np.float32(vs), "float8_e4m3fn")
        np.testing.assert_array_equal(got_k.numpy(), want_k)
        np.testing.assert_array_equal(got_v.numpy(), want_v)
        deq_k = R.fp8_decode(got_k.numpy(), "float8_e4m3fn") * ks
        np.testing.assert_allclose(deq_k, key.double().cpu().numpy(), atol=1e-3, rtol=0.1)
    else:
        torch.testing.assert_close(got_k, key.cpu(), atol=0, rtol=0)
        torch.testing.assert_close(got_v, value.cpu(), atol=0, rtol=0)
    # Nothing else was written.
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    written[blocks, offsets] = True
    assert not key_cache[~written].any() and not value_cache[~written].any()


# --- test_merge_attn_states.py ---------------------------------------------------------------

MERGE_GRID = list(itertools.product(
    [256, 512, 613, 1024, 1536, 4096],  # num_tokens
    [4, 8, 16, 32, 48, 64],  # num_query_heads
    [32, 48, 64, 96, 128, 256],  # head_size
    ["float32", "float16", "bfloat16"],  # output dtype
))


def _merge_torch_reference(po, pl, so, sl):
    """spec 4.12 in float32 torch (on the device)."""
    p = torch.where(torch.isinf(pl), torch.full_like(pl, -math.inf), pl)
    s = torch.where(torch.isinf(sl), torch.full_like(sl, -math.inf), sl)
    m = torch.maximum(p, s)
    empty = m == -math.inf
    m0 = torch.where(empty, torch.zeros_like(m), m)
    wp, ws = torch.exp(p - m0), torch.exp(s - m0)
    total = wp + ws
    scale_p = (wp / total).T.unsqueeze(-1)
    scale_s = (ws / total).T.unsqueeze(-1)
    out = po.float() * scale_p + so.float() * scale_s
    out = torch.where(empty.T.unsqueeze(-1), po.float(), out)
    lse = torch.where(empty, torch.full_like(m, -math.inf), torch.log(total) + m0)
    return out, lse


@pytest.mark.parametrize("num_tokens,num_heads,head_size,dtype", MERGE_GRID,
                         ids=lambda v: str(v))
def test_merge_attn_states(num_tokens, num_heads, head_size, dtype) -> None:
    torch.manual_seed(0)
    if ON_CPU and num_tokens * num_heads * head_size > 1 << 20:
        pytest.skip("large merge points run on CUDA only (PAGEDATTN_GRIDS_ON_CPU)")
    tdt = getattr(torch, dtype)
    pl = torch.randn(num_heads, num_tokens, dtype=torch.float32, device=DEVICE)
    sl = torch.randn(num_heads, num_tokens, dtype=torch.float32, device=DEVICE)
    # About 10% +inf per side, never both at once (as vLLM's test injects).
    mask_p = torch.rand(num_heads, num_tokens, device=DEVICE) < 0.1
    mask_s = (torch.rand(num_heads, num_tokens, device=DEVICE) < 0.1) & ~mask_p
    pl[mask_p] = math.inf
    sl[mask_s] = math.inf
    po = torch.randn(num_tokens, num_heads, head_size, dtype=tdt, device=DEVICE)
    so = torch.randn(num_tokens, num_heads, head_size, dtype=tdt, device=DEVICE)
    out = torch.empty_like(po)
    out_lse = torch.empty_like(pl)
    pt.merge_attn_states(out, po, pl, so, sl, out_lse)
    ref, ref_lse = _merge_torch_reference(po, pl, so, sl)
    rtol = 1e-2 if dtype == "bfloat16" else 1e-3
    torch.testing.assert_close(out.float(), ref.to(tdt).float(), atol=1e-3, rtol=rtol)
    torch.testing.assert_close(out_lse, ref_lse, atol=1e-3, rtol=rtol)


# --- tests/v1/attention/test_attention_backends.py batch specs -----------------------------

BATCH_SPECS = {
    "small_decode": ([32, 40], [1, 1]),
    "small_prefill": ([32, 40], [8, 8]),
    "mixed_small": ([32, 40, 48, 56], [1, 1, 5, 5]),
    "medium_decode": ([128, 256, 512, 1024, 128, 256, 512, 1024], [1] * 8),
    "medium_prefill": ([256, 512, 1024, 2048], [16] * 4),
    "mixed_medium": ([512, 1024, 2048, 512, 1024, 2048], [1, 1, 1, 7, 7, 7]),
    "large_decode": ([2048] * 32, [1] * 32),
    "large_prefill": ([4096] * 8, [32] * 8),
    "single_decode": ([1024], [1]),
    "single_prefill": ([1024], [64]),
}
# Llama-3-8B: 32 query heads, 8 KV heads, head_size 128, with heads split for TP 1/2/4.
LLAMA3_8B = (32, 8, 128)
# Phi-tiny-MoE (the sliding-window model of vLLM's test): 16/4 heads of 128, window 2047.
PHI_TINY_MOE = (16, 4, 128, 2047)


def _run_batch_spec(spec: str, num_heads: int, num_kv_heads: int, head_size: int,
                    window, seed: int = 0) -> None:
    """Context prefilled into a paged cache with randomised blocks; the step's new K/V go
    through the layer's own write; output checked against the float64 reference."""
    seq_lens, query_lens = BATCH_SPECS[spec]
    bs = 16
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    need = [-(-s // bs) for s in seq_lens]
    num_blocks = 1 + sum(need) + 8
    perm = rng.permutation(np.arange(1, num_blocks))
    ctx = pt.ForwardContext()
    layer = pt.Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads=num_kv_heads,
                         prefix=f"grid.{spec}", dtype=torch.bfloat16, device=DEVICE,
                         per_layer_sliding_window=window, context=ctx)
    kv = pt.allocate_kv_cache(num_blocks, bs, num_kv_heads, head_size, torch.bfloat16,
                              device=DEVICE)
    kv.normal_()
    layer.bind_kv_cache([kv])
    builder = pa.MetadataBuilder(bs)
    used = 0
    for s, q in zip(seq_lens, query_lens):
        n = -(-s // bs)
        builder.add(s - q, q, [int(b) for b in perm[used:used + n]])
        used += n
    step = builder.build()
    md = pt.AttentionMetadata.from_step(step, DEVICE)
    t = step.num_actual_tokens
    q = torch.randn(t, num_heads * head_size, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(t, num_kv_heads * head_size, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn(t, num_kv_heads * head_size, dtype=torch.bfloat16, device=DEVICE)
    with pt.set_forward_context(md, context=ctx):
        out = layer(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    ref, _ = R.attention_reference(
        q.view(t, num_heads, head_size).double().cpu().numpy(), step.query_start_loc,
        step.seq_lens, head_size ** -0.5,
        keys_of=_gathered_keys(kv[:, 0], kv[:, 1], md.block_table, step.seq_lens),
        sliding_window=window)
    assert_close_torch(out.view(t, num_heads, head_size), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("spec", list(BATCH_SPECS))
def test_causal_backend_correctness(spec: str, tp: int) -> None:
    hq, hk, d = LLAMA3_8B
    _run_batch_spec(spec, hq // tp, hk // tp, d, None)


@pytest.mark.parametrize(
    "spec", ["small_decode", "small_prefill", "mixed_medium", "large_decode", "large_prefill"])
def test_sliding_window_backend_correctness(spec: str) -> None:
    hq, hk, d, window = PHI_TINY_MOE
    _run_batch_spec(spec, hq, hk, d, window)
