"""FlashAttention's semantics as a float64 torch computation, its naive low-precision twin, and
the accuracy rules the FlashAttention-derived grids check with (test_flash_kvcache.py,
test_fa2_grids.py, test_fa3_grids.py). Written from FlashAttention's documented semantics."""

from __future__ import annotations

import math

import torch


def request64(q, k, v, causal, window, softcap, slope_row, scale, low_dtype=None, *, chunk=0,
              p_dtype=None):
    """One request: q [sq, h, d], k [sk, hk, d], v [sk, hk, dv] (values as given: dequantise
    fp8 first). Query i sits at a = i + sk - sq; causal keeps j <= a; window (left, right) keeps
    a - left <= j <= a + right (-1: unbounded; causal forces right 0); chunk C > 0 keeps keys of
    a's chunk [a - a mod C, a - a mod C + C); ALiBi adds -slope * |a - j|; a row with no key
    gives 0 (LSE -inf). float64, or with low_dtype the naive twin: float32 products and
    softmax, P rounded to p_dtype (default low_dtype) before P V, the output rounded to
    low_dtype. Returns (out [sq, h, dv], lse [h, sq]) in float64."""
    sq, h, _ = q.shape
    sk = k.shape[0]
    ct = torch.float32 if low_dtype is not None else torch.float64
    left, right = window
    if causal:
        right = 0
    g = h // k.shape[1]
    kk = k.to(ct).repeat_interleave(g, dim=1)  # [sk, h, d]
    vv = v.to(ct).repeat_interleave(g, dim=1)
    s = torch.einsum("ihd,jhd->hij", q.to(ct), kk) * scale  # [h, sq, sk]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    dev = q.device  # the reference runs where its inputs are (a GPU's float64 is fast)
    i = torch.arange(sq, device=dev)[:, None]
    j = torch.arange(sk, device=dev)[None, :]
    a = i + sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool, device=dev)
    if right >= 0:
        keep &= j <= a + right
    if left >= 0:
        keep &= j >= a - left
    if chunk > 0:
        start = a - a % chunk  # floor to the chunk (Python's % is non-negative)
        keep &= (j >= start) & (j < start + chunk)
    if slope_row is not None:
        s = s - slope_row.to(ct)[:, None, None] * (a - j).abs().to(ct)
    s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True) if sk > 0 else torch.full((h, sq, 1), -math.inf, dtype=ct,
                                                                   device=dev)
    empty = torch.isinf(m)
    m0 = torch.where(empty, torch.zeros_like(m), m)
    p = torch.exp(s - m0)
    den = p.sum(-1, keepdim=True)
    if low_dtype is not None:
        pv = p.to(p_dtype if p_dtype is not None else low_dtype).to(ct)
    else:
        pv = p
    o = torch.einsum("hij,jhd->ihd", pv, vv) / den.clamp(min=1e-300).transpose(0, 1)
    o = torch.where(empty.transpose(0, 1), torch.zeros_like(o), o)
    if low_dtype is not None:
        o = o.to(low_dtype)
    return o.double(), torch.where(empty, m, m0 + torch.log(den)).squeeze(-1).double()


def attention64(q, keys, values, causal, window, softcap, slopes, scale, low_dtype=None, *,
                chunk=0, p_dtype=None):
    """request64 over a batch: q [b, sq, h, d]; keys[r] / values[r] [sk_r, hk, d]; slopes
    [b, h] or None. Returns (out [b, sq, h, dv], lse [b, h, sq])."""
    outs, lses = [], []
    for r in range(q.shape[0]):
        o, lse = request64(q[r], keys[r], values[r], causal, window, softcap,
                           None if slopes is None else slopes[r], scale, low_dtype,
                           chunk=chunk, p_dtype=p_dtype)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rotate64(x, cos, sin, pos, interleaved):
    """x [b, s, h, d] rotated at pos [b, s] over its first 2 * cos.shape[1] dims, in float64,
    rounded to x's dtype (the rotated q and k are the kernel's inputs)."""
    half = cos.shape[1]
    if half == 0:
        return x
    c = cos.double()[pos].unsqueeze(2)
    s = sin.double()[pos].unsqueeze(2)
    y = x.double().clone()
    if interleaved:
        x1, x2 = y[..., 0:2 * half:2].clone(), y[..., 1:2 * half:2].clone()
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = y[..., :half].clone(), y[..., half:2 * half].clone()
        y[..., :half], y[..., half:2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return y.to(x.dtype)


def assert_rule(got, ref, naive, atol, what):
    """docs/testing.md: max|got - ref| <= 2 * max|naive - ref| + atol (non-finite mismatches
    fail)."""
    _assert_budget(got, ref, naive, 2.0, atol, what)


def assert_fa_rule(got, ref, naive, rtol, out_dtype, what):
    """FlashAttention 3's rule: max|got - ref| <= rtol * max|naive - ref| + 2 * max|(r + 0.3 -
    0.3) - r| with r the reference rounded to the output dtype (the rounding noise of one
    addition in that dtype)."""
    r = ref.to(out_dtype)
    noise = 2 * ((r + 0.3 - 0.3) - r).abs().max().item() if r.numel() else 0.0
    _assert_budget(got, ref, naive, rtol, noise, what)


def _assert_budget(got, ref, naive, rtol, atol, what):
    got, ref, naive = got.double().cpu(), ref.double().cpu(), naive.double().cpu()
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), f"{what}: non-finite differ"
    fin = torch.isfinite(ref)
    assert torch.equal(got[~fin], ref[~fin]), f"{what}: infinities differ"
    err = (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    budget = rtol * ((naive[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0) + atol
    assert err <= budget, f"{what}: max error {err} > budget {budget}"


def refused(error, on_cuda, allowed=()):
    """A NotSupported from the drop-ins: an expected failure (counted as xfailed, with its
    reason) when it names a feature this grid accepts as refused on this device, else a
    failure. On CUDA a head size outside the compiled set is accepted; on the CPU nothing is
    unless ``allowed`` names it (the CPU backend serves every feature these grids require)."""
    import pytest

    msg = str(error)
    ok = list(allowed) + (["head_size", "head size"] if on_cuda else [])
    if any(word in msg for word in ok):
        pytest.xfail(f"refused: {msg}")
    raise AssertionError(f"refused a feature the grid requires: {msg}") from error


def cap_lengths(seqlen_q, seqlen_k, cap):
    """Both lengths scaled by one factor so that neither exceeds cap (at least 1 each): the CPU
    keeps each pair's shape (q shorter, equal or longer) at a size it runs in seconds."""
    top = max(seqlen_q, seqlen_k)
    if top <= cap:
        return seqlen_q, seqlen_k
    f = cap / top
    return max(1, round(seqlen_q * f)), max(1, round(seqlen_k * f))
