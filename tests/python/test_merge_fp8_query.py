"""vLLM's newer merge_attn_states arguments (output_scale: an fp8 output; and
prefill_tokens_with_context) and fp8 queries in flash_attn_varlen_func, on CPU tensors (and
CUDA where present) against float64 computations.

``test_merge_attn_states_grid`` re-expresses vLLM's test_merge_attn_states grid (tokens x heads
x head sizes x output dtypes, about 10% infinite LSEs per side, never both) with its fp8-output
and prefill_tokens_with_context points; the CPU runs a seeded sample (grid_sampling.py).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from conftest import HAS_CUDA, HAS_TORCH
from grid_sampling import sample_grid

if not HAS_TORCH:
    pytest.skip("needs torch", allow_module_level=True)

import torch  # noqa: E402

import pagedattn as pa  # noqa: E402
import pagedattn.torch as pt  # noqa: E402
import reference as R  # noqa: E402
from grid_sampling import FULL_GRIDS  # noqa: E402
from torch_helpers import (  # noqa: E402
    TOLERANCE, assert_close_torch, make_torch_step, reference_for)

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
E4M3 = torch.float8_e4m3fn


def _merge_inputs(gen, n, h, d, dtype, device):
    """Random outputs and LSEs with about 10% +inf per side, never both at once."""
    pl = torch.randn(h, n, generator=gen)
    sl = torch.randn(h, n, generator=gen)
    mask_p = torch.rand(h, n, generator=gen) < 0.1
    mask_s = (torch.rand(h, n, generator=gen) < 0.1) & ~mask_p
    pl[mask_p] = math.inf
    sl[mask_s] = math.inf
    po = torch.randn(n, h, d, generator=gen).to(dtype)
    so = torch.randn(n, h, d, generator=gen).to(dtype)
    return [t.to(device) for t in (po, pl, so, sl)]


def _expected(po, pl, so, sl, with_context):
    """float64 (out [N, H, D], lse [H, N]): tokens before with_context merged (spec 4.12),
    the others the suffix's as given."""
    np_ = lambda t: t.double().cpu().numpy()  # noqa: E731
    out, lse = np_(so).copy(), np_(sl).copy()
    if with_context > 0:
        m_out, m_lse = R.merge_reference(np_(po[:with_context]), np_(pl[:, :with_context]),
                                         np_(so[:with_context]), np_(sl[:, :with_context]))
        out[:with_context], lse[:, :with_context] = m_out, m_lse
    return out, lse


def _assert_fp8(got, want_unscaled, scale, what="output"):
    """fp8 e4m3 codes against want / scale saturated to +-448: within half a unit in the last
    place (2^-4 relative, or 2^-10 among subnormals)."""
    want = np.clip(want_unscaled / scale, -448.0, 448.0)
    g = got.float().double().cpu().numpy()
    err = np.abs(g - want)
    bad = ~(err <= 2.0 ** -4 * np.abs(want) * 1.001 + 2.0 ** -10)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} codes off; max error "
                           f"{err.max()}")


def _assert_lse(got, ref, tol):
    """LSEs: equal infinities where the reference has them (the copied suffix keeps +inf),
    within tol elsewhere."""
    g = got.double().cpu().numpy()
    inf = np.isinf(ref)
    np.testing.assert_array_equal(g[inf], ref[inf])
    assert_close_torch(got.cpu()[torch.from_numpy(~inf)], ref[~inf], tol, tol, "lse")


# --- vLLM's test_merge_attn_states grid ------------------------------------------------------

MERGE_GRID = list(itertools.product(
    [256, 512, 613, 1024, 1536, 4096],  # num_tokens
    [4, 8, 16, 32, 48, 64],  # num_query_heads
    [32, 48, 64, 96, 128, 256],  # head_size
    ["float32", "float16", "bfloat16"],  # input dtype
    [None, 0.05],  # output_scale (an fp8 e4m3 output)
    [None, 128],  # prefill_tokens_with_context
))


# Without a GPU the sample leaves out the points over 2^21 elements (seconds each on two cores).
MERGE_POINTS = MERGE_GRID if HAS_CUDA or FULL_GRIDS else [
    p for p in MERGE_GRID if p[0] * p[1] * p[2] <= 1 << 21]


@pytest.mark.parametrize("point", sample_grid(MERGE_POINTS, 24, 400, HAS_CUDA, seed=1),
                         ids=lambda p: "-".join(str(v) for v in p))
def test_merge_attn_states_grid(point) -> None:
    n, h, d, dtype, output_scale, with_context = point
    device = DEVICES[-1]
    gen = torch.Generator().manual_seed(MERGE_GRID.index(point))
    po, pl, so, sl = _merge_inputs(gen, n, h, d, getattr(torch, dtype), device)
    fp8 = output_scale is not None
    # Poisoned: every element must be written.
    out = torch.full((n, h, d), float("nan"), device=device).to(E4M3 if fp8 else po.dtype)
    out_lse = torch.full((h, n), float("nan"), device=device)
    scale = torch.tensor([output_scale], device=device) if fp8 else None
    pt.merge_attn_states(out, po, pl, so, sl, out_lse, with_context, scale)
    ref, ref_lse = _expected(po, pl, so, sl, n if with_context is None else with_context)
    if fp8:
        _assert_fp8(out, ref, output_scale)
    else:
        atol, rtol = (1e-3, 1e-2) if dtype == "bfloat16" else (1e-3, 1e-3)
        assert_close_torch(out, ref, atol, rtol)
    _assert_lse(out_lse, ref_lse, 1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_tokens_without_context_copy_the_suffix(device: str) -> None:
    """Tokens from prefill_tokens_with_context on take the suffix verbatim (LSE +inf stays
    +inf: nothing is merged there), even where the prefix would dominate a merge."""
    gen = torch.Generator().manual_seed(2)
    po, pl, so, sl = _merge_inputs(gen, 40, 4, 64, torch.bfloat16, device)
    pl[:, 25:] = 50.0  # a merge would take the prefix
    sl[0, 30] = math.inf
    out, out_lse = torch.full_like(po, float("nan")), torch.full_like(pl, float("nan"))
    pt.merge_attn_states(out, po, pl, so, sl, out_lse, prefill_tokens_with_context=25)
    assert torch.equal(out[25:], so[25:]) and torch.equal(out_lse[:, 25:], sl[:, 25:])
    ref, ref_lse = _expected(po, pl, so, sl, 25)
    assert_close_torch(out[:25], ref[:25], 1e-2, 1e-2)
    _assert_lse(out_lse[:, :25], ref_lse[:, :25], 1e-5)
    out0 = torch.full_like(po, float("nan"))
    pt.merge_attn_states(out0, po, pl, so, sl, None, prefill_tokens_with_context=0)
    assert torch.equal(out0, so)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_fp8_output_saturates_and_keeps_empty_rows(device: str) -> None:
    """output_scale: merged / scale saturated to +-448; a row whose two LSEs are infinite takes
    the prefix output (the C++ kernel's rule); a float output_scale works like a tensor."""
    gen = torch.Generator().manual_seed(3)
    po, pl, so, sl = _merge_inputs(gen, 16, 2, 32, torch.float32, device)
    po[3] *= 1e4  # saturates: the prefix dominates row 3
    pl[:, 3], sl[:, 3] = 5.0, 0.0
    pl[:, 5], sl[:, 5] = math.inf, -math.inf
    out = torch.empty(16, 2, 32, device=device, dtype=E4M3)
    out_lse = torch.empty_like(pl)
    pt.merge_attn_states(out, po, pl, so, sl, out_lse, output_scale=0.5)
    ref, ref_lse = _expected(po, pl, so, sl, 16)
    _assert_fp8(out, ref, 0.5)
    assert (out[3].float().abs() == 448).any()
    assert torch.equal(out[5].float(), (po[5] / 0.5).clamp(-448, 448).to(E4M3).float())
    assert (out_lse[:, 5] == -math.inf).all()


def test_merge_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(4)
    po, pl, so, sl = _merge_inputs(gen, 8, 2, 32, torch.bfloat16, "cpu")
    with pytest.raises(pa.InvalidArgument, match="prefill_tokens_with_context \\(9\\)"):
        pt.merge_attn_states(torch.empty_like(po), po, pl, so, sl, None, 9)
    with pytest.raises(pa.InvalidArgument, match="pass output_scale"):
        pt.merge_attn_states(torch.empty(8, 2, 32, dtype=E4M3), po, pl, so, sl)
    with pytest.raises(pa.InvalidArgument, match="float8_e4m3fn; output is torch.bfloat16"):
        pt.merge_attn_states(torch.empty_like(po), po, pl, so, sl, output_scale=0.5)
    with pytest.raises(pa.NotSupported, match="one per-tensor scale"):
        pt.merge_attn_states(torch.empty(8, 2, 32, dtype=E4M3), po, pl, so, sl,
                             output_scale=torch.tensor([0.5, 0.25]))


# --- fp8 queries in flash_attn_varlen_func ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["", "ref"])
def test_fp8_query_varlen(device: str, kv_cache_dtype: str, backend: str) -> None:
    """q8 float8_e4m3fn with q_descale (vLLM's FA3 fp8 path) against float64 attention of
    q8 * q_descale. Over an e4m3 cache the ref backend computes it with query_quant (and cuda
    with its fp8-product kernels); the cpu backend attends the widened query."""
    if backend == "ref" and device == "cuda":
        pytest.skip("the ref backend runs on the CPU")
    fp8 = kv_cache_dtype != "auto"
    hq, hk, d = 8, 2, 64
    s = make_torch_step([(0, 7), (29, 1), (12, 4)], num_heads=hq, num_kv_heads=hk, head_size=d,
                        dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, device=device,
                        k_scale=0.05 if fp8 else 1.0, v_scale=0.07 if fp8 else 1.0)
    pt.reshape_and_cache_flash(s.k, s.v, s.key_cache, s.value_cache, s.slot_mapping,
                               kv_cache_dtype, s.k_scale, s.v_scale)
    q_descale = 0.03
    q8 = (s.q.float() / q_descale).to(E4M3)  # [T, Hq, D]
    out = torch.full(s.q.shape, float("nan"), dtype=torch.bfloat16, device=device)
    got, lse = pt.flash_attn_varlen_func(
        q8, s.key_cache, s.value_cache, s.max_seqlen_q, s.cu_seqlens_q, s.max_seqlen_k,
        seqused_k=s.seqused_k, block_table=s.block_table, softmax_scale=d ** -0.5, causal=True,
        out=out, return_softmax_lse=True, q_descale=torch.tensor([q_descale], device=device),
        k_descale=s.k_scale, v_descale=s.v_scale, backend=backend)
    assert got is out
    q_real = q8.double() * q_descale
    s.q = q_real  # the reference reads s.q
    ref, ref_lse = reference_for(s, d ** -0.5)
    t_a = s.num_actual_tokens
    atol, rtol = TOLERANCE[torch.bfloat16]
    assert_close_torch(got[:t_a], ref, atol, rtol)
    lse_tol = 4e-3 if device == "cuda" and fp8 else 1e-3  # fp8 products round their sums
    assert_close_torch(lse[:, :t_a], ref_lse, lse_tol, lse_tol, "lse")


def test_fp8_query_without_out_is_bfloat16_and_e5m2_is_refused() -> None:
    s = make_torch_step([(0, 3)], num_heads=4, num_kv_heads=4, head_size=32, dtype="float32")
    q8 = s.q.to(E4M3)
    got = pt.flash_attn_varlen_func(q8, s.key_cache.bfloat16(), s.value_cache.bfloat16(),
                                    s.max_seqlen_q, s.cu_seqlens_q, s.max_seqlen_k,
                                    seqused_k=s.seqused_k, block_table=s.block_table,
                                    causal=True, q_descale=torch.tensor(1.0))
    assert got.dtype == torch.bfloat16
    with pytest.raises(pa.NotSupported, match="float8_e4m3fn"):
        pt.flash_attn_varlen_func(s.q.to(torch.float8_e5m2), s.key_cache, s.value_cache,
                                  s.max_seqlen_q, s.cu_seqlens_q, s.max_seqlen_k,
                                  seqused_k=s.seqused_k, block_table=s.block_table, causal=True)
    with pytest.raises(pa.NotSupported, match="q_descale"):
        pt.flash_attn_varlen_func(q8, s.key_cache.bfloat16(), s.value_cache.bfloat16(),
                                  s.max_seqlen_q, s.cu_seqlens_q, s.max_seqlen_k,
                                  seqused_k=s.seqused_k, block_table=s.block_table, causal=True,
                                  q_descale=torch.tensor([[1.0, 2.0]]))
