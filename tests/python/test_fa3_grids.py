"""pagedattn.torch.fa3 (FlashAttention 3's signatures) over FlashAttention 3's
test_flash_attn_varlen_output grid (hopper/test_flash_attn.py), re-expressed from its
documented grid and tolerance, not from its code.

The grid: 22 (seqlen_q, seqlen_k) pairs, head sizes 64..256 with their value head sizes (dv 256
and 512 for d <= 64, 128 for 128 < d <= 192), MHA / GQA / MQA (6 query heads over 6 / 2 / 1
KV heads), batch 9 (2 past 2048 queries), soft cap 0 / 15, causal, a random local window, a
random attention_chunk (when seqlen_q <= seqlen_k) or none, unused query / key rows addressed
through seqused_q / seqused_k (add_unused_qkv), qv (d 64 only), bfloat16 / float16 / fp8 e4m3
with random per-request, per-KV-head descales [batch, kv_heads]. Query lengths are drawn from
[max(1, s - 20), s]; key lengths from [max(0, s - 20), s] with requests 0, 5 and the last
given no keys. The pack_gqa and num_splits loops collapse (hints here).

Tolerance, FlashAttention 3's: max|out - ref| <= rtol * max|naive - ref| + 2 * max|(r + 0.3 -
0.3) - r| with rtol 2 (3 with a soft cap), r the reference rounded to the output dtype, naive
the low-precision twin (P rounded to e4m3 for fp8, as upstream's intermediate dtype). Rows past
seqused_q must be 0. The backward half of the upstream test has no counterpart.

A sample runs on the CPU (pairs scaled to at most 160 tokens), more with a GPU;
PAGEDATTN_FULL_GRIDS=1 runs every point. Refusals: flash_reference.refused.
"""

from __future__ import annotations

import itertools

import pytest

from conftest import HAS_CUDA, HAS_TORCH
from grid_sampling import sample_grid

if not HAS_TORCH:
    pytest.skip("needs torch", allow_module_level=True)

import torch  # noqa: E402

import pagedattn as pa  # noqa: E402
from flash_reference import (assert_fa_rule, assert_rule, cap_lengths, refused,  # noqa: E402
                             request64, rotate64)
from pagedattn.torch import fa3  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
E4M3 = torch.float8_e4m3fn

SEQLENS = [(1, 1), (1, 3), (2, 1), (511, 1), (3, 513), (64, 128), (128, 128), (256, 256),
           (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (307, 256), (640, 128),
           (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (1024, 1024), (2048, 2048),
           (4096, 4096)]


def _dv_values(d, dtype, has_qv):
    if has_qv:
        return [256, 512]
    if dtype == "float8_e4m3fn":
        return [d]
    if 128 < d <= 192:
        return [128, d]
    return sorted({256, 512, d}) if d <= 64 else [d]


def _grid():
    points = []
    for (sq, sk), d, unused, causal, local, softcap, has_qv, mha, dtype in itertools.product(
            SEQLENS, [64, 96, 128, 192, 256], [False, True], [False, True], [False, True],
            [0.0, 15.0], [False, True], ["mha", "mqa", "gqa"],
            ["bfloat16", "float16", "float8_e4m3fn"]):
        if has_qv and (d != 64 or dtype == "float8_e4m3fn"):
            continue  # upstream: qv needs d 64 and a 16-bit dtype
        for dv in _dv_values(d, dtype, has_qv):
            for chunk in (["random", 0] if sq <= sk else [0]):
                points.append(((sq, sk), d, dv, chunk, unused, causal, local, softcap, has_qv,
                               mha, dtype))
    return points


VARLEN_OUTPUT_GRID = _grid()


def _point_id(p) -> str:
    return "-".join(str(v) for v in p) if isinstance(p, tuple) else str(p)


def _lengths(gen, s, batch, zero_lengths=False):
    """FlashAttention's "random" padding; with zero_lengths requests 0, 5, ... and the last
    have none."""
    lens = [int(x) for x in torch.randint(max(0 if zero_lengths else 1, s - 20), s + 1,
                                          (batch,), generator=gen)]
    if zero_lengths:
        lens = [0 if (i % 5 == 0 or i == batch - 1) else n for i, n in enumerate(lens)]
    return lens


@pytest.mark.parametrize("index,point",
                         sample_grid(list(enumerate(VARLEN_OUTPUT_GRID)), 8, 400, HAS_CUDA,
                                     seed=3),
                         ids=_point_id)
def test_flash_attn_varlen_output(index, point) -> None:
    ((seqlen_q, seqlen_k), d, dv, chunk_kind, unused, causal, local, softcap, has_qv, mha,
     dtype) = point
    if not HAS_CUDA:
        seqlen_q, seqlen_k = cap_lengths(seqlen_q, seqlen_k, 160)
    gen = torch.Generator().manual_seed(index)
    fp8 = dtype == "float8_e4m3fn"
    tdt = getattr(torch, dtype)
    ref_dt = torch.bfloat16 if fp8 else tdt  # the inputs are drawn in this dtype
    out_dt = torch.bfloat16 if fp8 else tdt
    batch = 9 if seqlen_q <= 2048 else 2
    nheads = 6
    hk = {"mha": 6, "gqa": 2, "mqa": 1}[mha]
    chunk = (int(torch.randint(1, 2 * seqlen_k, (1,), generator=gen)) if chunk_kind == "random"
             else 0)
    q = torch.randn(batch, seqlen_q, nheads, d, generator=gen).to(ref_dt)
    if softcap > 0:
        q = q * softcap / 4  # logits reach the cap's range
    q = q.to(tdt)
    k = torch.randn(batch, seqlen_k, hk, d, generator=gen).to(ref_dt).to(tdt)
    v = torch.randn(batch, seqlen_k, hk, dv, generator=gen).to(ref_dt).to(tdt)
    qv = torch.randn(batch, seqlen_q, nheads, dv, generator=gen).to(tdt) if has_qv else None
    window = (tuple(int(x) for x in torch.randint(0, seqlen_k, (2,), generator=gen))
              if local else (-1, -1))
    descales = [torch.rand(batch, hk, generator=gen) * 2 for _ in range(3)] if fp8 else None

    # Per request: used rows (attended) and stored rows (used + unused, addressed through
    # seqused_q / seqused_k when add_unused_qkv).
    used_q = _lengths(gen, seqlen_q, batch)
    used_k = _lengths(gen, seqlen_k, batch, zero_lengths=True)
    stored_q, stored_k = list(used_q), list(used_k)
    if unused:
        other_q, other_k = _lengths(gen, seqlen_q, batch), _lengths(gen, seqlen_k, batch)
        stored_q = [max(a, b) for a, b in zip(used_q, other_q)]
        stored_k = [max(a, b) for a, b in zip(used_k, other_k)]
        used_q = [min(a, b) for a, b in zip(used_q, other_q)]
        used_k = [min(a, b) for a, b in zip(used_k, other_k)]
    cu_q = torch.tensor([0] + stored_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + stored_k).cumsum(0).to(torch.int32)
    cat = lambda x, lens: torch.cat([x[r, :lens[r]] for r in range(batch)])  # noqa: E731
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    seqused_q = torch.tensor(used_q, dtype=torch.int32) if unused else None
    seqused_k = torch.tensor(used_k, dtype=torch.int32) if unused else None
    try:
        out = fa3.flash_attn_varlen_func(
            dev(cat(q, stored_q)), dev(cat(k, stored_k)), dev(cat(v, stored_k)), dev(cu_q),
            dev(cu_k), max(stored_q), max(stored_k), seqused_q=dev(seqused_q),
            seqused_k=dev(seqused_k), causal=causal,
            qv=dev(cat(qv, stored_q)) if has_qv else None,
            q_descale=dev(descales[0]) if fp8 else None,
            k_descale=dev(descales[1]) if fp8 else None,
            v_descale=dev(descales[2]) if fp8 else None, window_size=window,
            attention_chunk=chunk, softcap=softcap, num_splits=3, pack_gqa=True)
    except pa.NotSupported as e:
        refused(e, HAS_CUDA)
    assert out.shape == (int(cu_q[-1]), nheads, dv) and out.dtype == out_dt
    out = out.cpu()
    g = nheads // hk
    scale = (d + (dv if has_qv else 0)) ** -0.5
    rtol = 2 if softcap == 0.0 else 3
    for r in range(batch):
        qr, kr, vr = (q[r, :used_q[r]].double(), k[r, :used_k[r]].double(),
                      v[r, :used_k[r]].double())
        if fp8:  # the values the descales give the fp8 codes
            qd, kd, vd = (s[r].double() for s in descales)
            qr = qr * qd.repeat_interleave(g)[None, :, None]
            kr, vr = kr * kd[None, :, None], vr * vd[None, :, None]
        if has_qv:  # <q, k> + <qv, v> is one dot product of [q, qv] with [k, v]
            qr = torch.cat((qr, qv[r, :used_q[r]].double()), dim=-1)
            kr = torch.cat((kr, vr), dim=-1)
        args = (dev(qr), dev(kr), dev(vr), causal, window, softcap, None, scale)
        ref, _ = request64(*args, chunk=chunk)
        naive, _ = request64(*args, out_dt, chunk=chunk, p_dtype=E4M3 if fp8 else None)
        got = out[cu_q[r]:cu_q[r + 1]]
        assert_fa_rule(got[:used_q[r]], ref, naive, rtol, out_dt, f"request {r}")
        assert (got[used_q[r]:] == 0).all(), f"request {r}: rows past seqused_q are not 0"


# --- the rest of FlashAttention 3's interface ----------------------------------------------


def test_fa3_func_lse_and_kvcache() -> None:
    """flash_attn_func returns (out, lse [b, h, sq]) with return_attn_probs; the qkv-packed
    form (GQA through num_heads_q) agrees; flash_attn_with_kvcache reads a page_table."""
    gen = torch.Generator().manual_seed(11)
    b, sq, sk, h, hk, d = 2, 4, 9, 4, 2, 64
    q = torch.randn(b, sq, h, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, sk, hk, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, sk, hk, d, generator=gen).to(torch.bfloat16)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, window_size=(3, 0),
                                   return_attn_probs=True)
    assert lse.shape == (b, h, sq)
    for r in range(b):
        ref, ref_lse = request64(q[r], k[r], v[r], True, (3, 0), 0.0, None, d ** -0.5)
        naive, naive_lse = request64(q[r], k[r], v[r], True, (3, 0), 0.0, None, d ** -0.5,
                                     torch.bfloat16)
        assert_rule(out[r], ref, naive, 1e-4, "output")
        assert_rule(lse[r], ref_lse, naive_lse, 1e-5, "lse")
    cu4 = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
    batched_k = fa3.flash_attn_varlen_func(q.flatten(0, 1), k, v, cu4, None, sq, sk, causal=True,
                                           window_size=(3, 0))
    assert torch.equal(batched_k, out.flatten(0, 1))  # keys batched when cu_seqlens_k is None
    qkv = torch.cat((q, k[:, :sq], v[:, :sq]), dim=2)
    got = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=h)
    assert torch.equal(got, fa3.flash_attn_func(q, k[:, :sq], v[:, :sq], causal=True))
    # The same keys as a paged cache of 4-token blocks.
    kc = torch.zeros(8, 4, hk, d, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    table = torch.tensor([[5, 1, 7], [0, 6, 2]], dtype=torch.int32)
    for r in range(b):
        for j in range(sk):
            kc[table[r, j // 4], j % 4] = k[r, j]
            vc[table[r, j // 4], j % 4] = v[r, j]
    res = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk, page_table=table, causal=True,
                                      window_size=(3, 0), return_softmax_lse=True)
    o2, l2, *_ = res
    assert_rule(o2, out.double(), out.double(), 1e-2, "kvcache output")
    # Without new k / v the cache is read as varlen attention: attention_chunk and a varlen
    # q (left as the first 3 and 2 queries of each request's 4) are served.
    lens = [3, 2]
    qf = torch.cat([q[r, :lens[r]] for r in range(b)])
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    seqlens = torch.tensor([9, 6], dtype=torch.int32)
    got, got_lse = fa3.flash_attn_with_kvcache(
        qf, kc, vc, cache_seqlens=seqlens, page_table=table, cu_seqlens_q=cu_q, max_seqlen_q=3,
        causal=True, attention_chunk=4, return_softmax_lse=True)
    assert got.shape == (5, h, d) and got_lse.shape == (h, 5)
    for r in range(b):
        n = int(seqlens[r])
        args = (q[r, :lens[r]], k[r, :n], v[r, :n], True, (-1, -1), 0.0, None, d ** -0.5)
        ref, _ = request64(*args, chunk=4)
        naive, _ = request64(*args, torch.bfloat16, chunk=4)
        assert_rule(got[cu_q[r]:cu_q[r + 1]], ref, naive, 1e-4, f"chunked request {r}")
    # New keys appended in place (rotated), then attended: against the reference over the
    # cache as the test expects it afterwards.
    kc2, vc2 = kc.clone(), vc.clone()
    k_new = torch.randn(b, 2, hk, d, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(b, 2, hk, d, generator=gen).to(torch.bfloat16)
    angle = torch.rand(16, 8, generator=gen) * 6.28
    cos, sin = torch.cos(angle).to(torch.bfloat16), torch.sin(angle).to(torch.bfloat16)
    start = torch.tensor([5, 7], dtype=torch.int32)
    got = fa3.flash_attn_with_kvcache(q, kc2, vc2, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=start, page_table=table, causal=True,
                                      attention_chunk=3, rotary_interleaved=False)
    for r in range(b):
        s0 = int(start[r])
        kr = rotate64(k_new[r:r + 1], cos, sin, torch.arange(s0, s0 + 2)[None], False)[0]
        qr = rotate64(q[r:r + 1], cos, sin, torch.arange(s0, s0 + sq)[None], False)[0]
        slots = [int(table[r, j // 4]) * 4 + j % 4 for j in range(s0, s0 + 2)]
        torch.testing.assert_close(kc2.view(-1, hk, d)[slots].float(), kr.float(), atol=1e-3,
                                   rtol=2 ** -7)  # one rounding apart at most
        assert torch.equal(vc2.view(-1, hk, d)[slots], v_new[r])
        keys = torch.cat((k[r, :s0], kr))
        vals = torch.cat((v[r, :s0], v_new[r]))
        args = (qr, keys, vals, True, (-1, -1), 0.0, None, d ** -0.5)
        ref, _ = request64(*args, chunk=3)
        naive, _ = request64(*args, torch.bfloat16, chunk=3)
        assert_rule(got[r], ref, naive, 1e-4, f"appended request {r}")


def test_fa3_combine() -> None:
    """flash_attn_combine merges split results by their LSEs (float32)."""
    gen = torch.Generator().manual_seed(12)
    splits, b, s, h, d = 3, 2, 5, 4, 8
    outp = torch.randn(splits, b, s, h, d, generator=gen)
    lsep = torch.randn(splits, b, s, h, generator=gen)
    lsep[1, 0, 0, 0] = float("-inf")
    got = fa3.flash_attn_combine(outp, lsep, out_dtype=torch.float32)
    w = torch.softmax(lsep.double(), dim=0)
    ref = (outp.double() * w.unsqueeze(-1)).sum(0)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_fa3_gradients_refused() -> None:
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(1, 3, 2, 64, generator=gen, requires_grad=True)
    k = torch.randn(1, 3, 2, 64, generator=gen)
    out = fa3.flash_attn_func(q, k, k, causal=True)
    with pytest.raises(pa.NotSupported, match="gradients"):
        out.sum().backward()


def _served_keys(plans, left, right, causal, q_start, sq):
    """The keys each query row sees when the op runs plan_virtual's requests (bottom-right
    aligned causal / non-causal blocks with their windows)."""
    from pagedattn.torch import _fa_common as C

    if causal:
        right = 0
    seen = {i: set() for i in range(sq)}
    for plan, is_causal in ((plans[0], True), (plans[1], False)):
        w = (left + right + 1 if is_causal else left + 1) if left >= 0 else 0
        for r, q0, nq, lo, nk in zip(plan.req, plan.q0, plan.nq, plan.lo, plan.nk):
            for i in range(nq):
                assert not seen[q0 + i - q_start], "a query row in two virtual requests"
                a = i + nk - nq
                first = max(0, a - w + 1) if w > 0 else 0
                last = a if is_causal else nk - 1
                seen[q0 + i - q_start].update(lo + j for j in range(first, last + 1))
    assert isinstance(plans[0], C.VirtualPlan)
    return seen


def test_plan_virtual_matches_the_mask() -> None:
    """Virtual requests cover exactly FlashAttention's mask (causal, windows bounded on either
    side, attention_chunk, q longer than k, no keys), checked exhaustively on small shapes."""
    from pagedattn.torch._fa_common import plan_virtual

    gen = torch.Generator().manual_seed(14)
    for trial in range(400):
        sq, sk = (int(x) for x in torch.randint(0, 12, (2,), generator=gen))
        causal = bool(trial % 2)
        left, right, chunk = (int(x) for x in torch.randint(-1, 8, (3,), generator=gen))
        chunk = max(chunk, 0)
        plans = plan_virtual([3], [sq], [sk], causal, left, right, chunk)
        seen = _served_keys(plans, left, right, causal, 3, sq)
        r_eff = 0 if causal else right
        for i in range(sq):
            a = i + sk - sq
            want = {j for j in range(sk)
                    if (r_eff < 0 or j <= a + r_eff) and (left < 0 or j >= a - left)
                    and (chunk == 0 or a - a % chunk <= j < a - a % chunk + chunk)}
            assert seen[i] == want, (sq, sk, causal, left, right, chunk, i)
