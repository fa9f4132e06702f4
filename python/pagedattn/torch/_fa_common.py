"""Pieces shared by the FlashAttention 2 and 3 drop-ins (fa2.py, fa3.py).

The attention op serves, per request, a bottom-right aligned causal block with a left window,
or a non-causal block with a left window. FlashAttention's masks are more general: a window
bounded on the right, Llama-4's chunked local attention (``attention_chunk``), query rows past
``seqused_q``. Every one of them still gives each query an interval of keys, and the intervals
of consecutive queries move together, so a request splits into at most two "virtual requests"
per chunk that the op serves: a causal one (the queries whose right bound lies inside the keys)
and a non-causal one (the queries that see up to the last key of their chunk). ``plan_virtual``
makes that split on the host; ``attend_virtual`` runs it with one op call per kind, reading the
keys as one-token pages, so a virtual request may start at any key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from pagedattn import _C


def window_pair(window_size: Optional[Sequence[int]]) -> Tuple[int, int]:
    """(left, right) ints from FlashAttention's window_size (a tuple, list or 2-element tensor);
    any negative bound means unbounded (-1)."""
    if window_size is None:
        return -1, -1
    vals = [int(x) for x in (window_size.tolist() if isinstance(window_size, torch.Tensor)
                             else window_size)]
    if len(vals) != 2:
        raise _C.InvalidArgument(f"window_size must be (left, right); got {window_size}")
    return max(vals[0], -1), max(vals[1], -1)


@dataclass
class VirtualPlan:
    """Virtual requests of one kind: query rows [q0, q0 + nq) of the batch attend keys
    [lo, lo + nk) of request ``req``."""
    req: List[int] = field(default_factory=list)
    q0: List[int] = field(default_factory=list)
    nq: List[int] = field(default_factory=list)
    lo: List[int] = field(default_factory=list)
    nk: List[int] = field(default_factory=list)

    def add(self, req: int, q0: int, nq: int, lo: int, nk: int) -> None:
        if nq > 0 and nk > 0:
            self.req.append(req)
            self.q0.append(q0)
            self.nq.append(nq)
            self.lo.append(lo)
            self.nk.append(nk)


def plan_virtual(q_starts: Sequence[int], q_lens: Sequence[int], k_lens: Sequence[int],
                 causal: bool, left: int, right: int,
                 chunk: int) -> Tuple[VirtualPlan, VirtualPlan]:
    """(causal, non_causal) virtual requests for FlashAttention's mask.

    Query i of request r (q_lens[r] rows from q_starts[r], k_lens[r] keys) sits at
    a = i + k_lens[r] - q_lens[r] and sees key j iff j <= a + right (right = 0 when causal;
    -1 = no bound), j >= a - left (-1 = no bound) and, with chunk C > 0, floor(j / C) ==
    floor(a / C). Queries that see no key are in neither plan (their output is 0, LSE -inf).
    Causal requests use the sliding window left + right + 1 (0 = none when left is -1),
    non-causal ones left + 1 (see attend_virtual)."""
    if causal:
        right = 0
    cz, nc = VirtualPlan(), VirtualPlan()
    for r, (start, sq, sk) in enumerate(zip(q_starts, q_lens, k_lens)):
        if sq <= 0 or sk <= 0:
            continue
        off = sk - sq
        a_first, a_last = off, sk - 1
        if chunk > 0:
            segments = []
            c = a_first - a_first % chunk
            while c <= a_last:
                segments.append((max(a_first, c), min(a_last, c + chunk - 1), c, c + chunk))
                c += chunk
        else:
            segments = [(a_first, a_last, None, None)]
        for a0, a1, cs, ce in segments:
            base = 0 if cs is None else max(cs, 0)
            hi_max = sk - 1 if ce is None else min(sk - 1, ce - 1)  # == a1 (see module doc)
            if hi_max < base:
                continue  # every query of the segment lies before key 0
            # The first a whose right bound reaches hi_max (every a when there is no bound).
            split = a0 if right < 0 else hi_max - right
            # Causal part: a in [a0, min(a1, split - 1)], keys up to a + right.
            c0, c1 = max(a0, base - right if right >= 0 else a0), min(a1, split - 1)
            if right >= 0 and c1 >= c0:
                cz.add(r, start + c0 - off, c1 - c0 + 1, base, c1 + right + 1 - base)
            # Non-causal part: a in [max(a0, split), a1], keys up to hi_max.
            n0 = max(a0, split)
            if n0 <= a1:
                nc.add(r, start + n0 - off, a1 - n0 + 1, base, hi_max + 1 - base)
    return cz, nc


class PagedKeys:
    """Request r's key j as a one-token page: packed K/V (row cu_k[r] + j) or a paged cache
    (block_table[r, j // bs], offset j % bs)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cu_k: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None):
        if block_table is None:
            self.k, self.v = k.unsqueeze(1), v.unsqueeze(1)  # [total_k, 1, Hk, D]
            self.starts = cu_k[:-1].long()
            self.bs = 0
        else:
            # A view for caches whose blocks are contiguous; otherwise a copy (read only).
            self.k = k.reshape(-1, 1, *k.shape[2:])
            self.v = v.reshape(-1, 1, *v.shape[2:])
            self.table = block_table.long()
            self.bs = k.shape[1]
        self.count = self.k.shape[0]

    def slots(self, req: torch.Tensor, lo: torch.Tensor, width: int) -> torch.Tensor:
        """int32 [V, width]: the pages of keys lo[v] .. lo[v] + width - 1 of request req[v]
        (entries past a request's keys are clamped into range and never read)."""
        j = lo[:, None] + torch.arange(width, device=lo.device)[None, :]
        if self.bs == 0:
            s = self.starts[req][:, None] + j
        else:
            col = (j // self.bs).clamp(max=self.table.shape[1] - 1)
            s = self.table[req[:, None], col] * self.bs + j % self.bs
        return s.clamp(0, max(self.count - 1, 0)).to(torch.int32)


def attend_virtual(q: torch.Tensor, keys: PagedKeys, plans: Tuple[VirtualPlan, VirtualPlan],
                   left: int, right: int, causal: bool, out: torch.Tensor, lse: torch.Tensor,
                   scale: float, softcap: float, cache_dtype: str, k_scale: float,
                   v_scale: float, backend: str, query_quant: bool = False) -> None:
    """Runs plan_virtual's requests: out [T, H, Dv] and lse [H, T] must hold 0 / -inf for the
    rows no plan covers. One op call per non-empty kind."""
    if causal:
        right = 0
    dev = q.device
    for plan, kind in ((plans[0], "decoder"), (plans[1], "encoder_decoder")):
        if not plan.req:
            continue
        if kind == "decoder":
            window = left + right + 1 if left >= 0 else 0
        else:
            window = left + 1 if left >= 0 else 0
        rows = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(plan.q0, plan.nq)])
        width = max(plan.nk)
        table = keys.slots(torch.tensor(plan.req, device=dev), torch.tensor(plan.lo, device=dev),
                           width)
        cu_host = torch.tensor([0] + plan.nq, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        nk_host = torch.tensor(plan.nk, dtype=torch.int32)
        qs = q.index_select(0, rows)
        o = torch.empty((qs.shape[0], q.shape[1], out.shape[2]), dtype=out.dtype, device=dev)
        l_ = torch.empty((q.shape[1], qs.shape[0]), dtype=torch.float32, device=dev)
        on_cuda = dev.type == "cuda"
        torch.ops.pagedattn.attention(
            qs, None, None, keys.k, keys.v, cu_host.to(dev), nk_host.to(dev), table, o, l_,
            max(plan.nq), width, int(cu_host[-1]), kind, scale, window, softcap, None, None,
            cache_dtype, k_scale, v_scale, cu_host if on_cuda else None,
            nk_host if on_cuda else None, backend, query_quant)
        out.index_copy_(0, rows, o)
        lse.index_copy_(1, rows, l_)


def host_ints(x: Optional[torch.Tensor]) -> Optional[List[int]]:
    """A small index tensor read on the host (a device sync for a CUDA tensor)."""
    return None if x is None else [int(v) for v in x.tolist()]


def row_requests(cu_q: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: the request of each query row (rows past cu_q[-1] get the last one)."""
    rows = torch.arange(total, device=cu_q.device)
    b = cu_q.shape[0] - 1
    return torch.bucketize(rows, cu_q[1:].long(), right=True).clamp(max=max(b - 1, 0))


def per_row_head(scale: Optional[torch.Tensor], name: str, batch: int, kv_heads: int,
                 heads: int, row_req: torch.Tensor) -> Optional[torch.Tensor]:
    """FlashAttention 3's descale ([batch, num_kv_heads], or one value) as float32
    [rows, heads]: each query head takes its KV head's value, each row its request's."""
    if scale is None:
        return None
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    s = s.to(device=row_req.device, dtype=torch.float32)
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(batch, kv_heads)
    if tuple(s.shape) != (batch, kv_heads):
        raise _C.InvalidArgument(
            f"{name} must be [batch={batch}, num_kv_heads={kv_heads}] (or one value); got "
            f"shape {list(s.shape)}")
    return s.repeat_interleave(heads // kv_heads, dim=1)[row_req]


class _NoBackward(torch.autograd.Function):
    """Passes the forward result through; its backward refuses with the reason (pagedattn
    computes no gradients), so a caller that only runs the forward pass is served."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - raises
        raise _C.NotSupported("gradients: pagedattn implements the forward pass only "
                              "(inference); FlashAttention's backward is not offered")


def unpack(t: torch.Tensor, parts: int, dim: int, name: str, layout: str):
    """The `parts` tensors packed along `dim` of `t` (FlashAttention's kv / qkv packed forms);
    InvalidArgument naming `name` and its `layout` otherwise."""
    if t.dim() != dim + 3 or t.shape[dim] != parts:
        raise _C.InvalidArgument(f"{name} must be {layout}; got {list(t.shape)}")
    return t.unbind(dim=dim)


def batched_as_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Batched q [b, sq, h, d] and k / v [b, sk, hk, d / dv] as varlen requests of equal
    lengths: (q [b*sq, h, d], k, v [b*sk, hk, ...], cu_seqlens_q, cu_seqlens_k, sq, sk)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise _C.InvalidArgument(
            f"q, k, v must be [batch, seqlen, heads, dim]; got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}")
    b, sq = q.shape[:2]
    sk = k.shape[1]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sq
    cu_k = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sk
    return (q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
            v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, sq, sk)


def no_backward(out: torch.Tensor, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
    """out, tied to the inputs that require grad so that backward raises NotSupported."""
    needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needs or not torch.is_grad_enabled():
        return out
    return _NoBackward.apply(out, *needs)


def check_inference(dropout_p: float = 0.0) -> None:
    if dropout_p != 0.0:
        raise _C.NotSupported(f"dropout_p ({dropout_p}) must be 0: pagedattn is inference only")


def varlen_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                cu_k: Optional[torch.Tensor], max_q: int, max_k: int, *,
                seqused_q: Optional[torch.Tensor] = None,
                seqused_k: Optional[torch.Tensor] = None,
                block_table: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                causal: bool = False, window_size=None, chunk: int = 0, softcap: float = 0.0,
                alibi_slopes=None, qv: Optional[torch.Tensor] = None, q_descale=None,
                k_descale=None, v_descale=None, out: Optional[torch.Tensor] = None,
                backend: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen forward over the pagedattn ops: (out [T, H, Dv], lse float32
    [H, T]). Served directly by flash_attn.flash_attn_varlen_func where its masks suffice,
    otherwise through plan_virtual (host sync for the lengths)."""
    from pagedattn.torch import flash_attn as fa
    from pagedattn.torch import _ops

    if q.dim() != 3 or k.dim() not in (3, 4) or v.dim() != k.dim():
        raise _C.InvalidArgument(
            f"q must be [total_q, heads, d] and k / v [total_k, kv_heads, d] (or paged "
            f"[blocks, block_size, kv_heads, d]); got {list(q.shape)}, {list(k.shape)}, "
            f"{list(v.shape)}")
    if chunk < 0:
        raise _C.InvalidArgument(f"attention_chunk ({chunk}) must be >= 0")
    left, right = window_pair(window_size)
    if causal:
        right = 0  # FlashAttention: causal bounds the window on the right at the query
    T, H, D = q.shape
    Hk = k.shape[-2]
    if Hk == 0 or H % Hk != 0:
        raise _C.InvalidArgument(f"heads ({H}) must be a multiple of kv_heads ({Hk})")
    dv = v.shape[-1]
    batch = cu_q.shape[0] - 1
    if scale is None:
        scale = (D + (qv.shape[-1] if qv is not None else 0)) ** -0.5
    scale = float(scale)
    fp8 = q.dtype == torch.float8_e4m3fn
    if q.dtype in (torch.float8_e5m2, torch.uint8):
        raise _C.NotSupported(f"q of dtype {q.dtype}: fp8 queries are float8_e4m3fn")
    out_dtype = (out.dtype if out is not None else torch.bfloat16) if fp8 else q.dtype
    if qv is not None:
        if fp8:
            raise _C.NotSupported("qv with an fp8 query is not supported (FlashAttention 3 "
                                  "has no fp8 qv either)")
        # <q, k> + <qv, v> is one dot product of [qv, q] with [v, k]; P [v, k] holds P v in
        # its first dv columns, so one tensor serves as keys and values (MLA's latent layout:
        # on CUDA, d + dv = 576 with one KV head runs on the MLA latent kernel).
        q = torch.cat((qv.to(q.dtype), q), dim=-1)
        k = torch.cat((v, k), dim=-1)
        v = k
    elif dv != D and (dv > D or q.is_cuda):
        # The op serves dv < d (v_head_size) on the cpu and ref backends (cuda with its option
        # v_head=on only); a wider V, or any dv != d on CUDA, becomes one head size: zero
        # columns appended to q and k (the dot products unchanged; the scale stays d's) or to
        # v (sliced off the output).
        width = max(D, dv)
        q, k, v = (_pad_last(t, width) for t in (q, k, v))
    step = 16 if k.element_size() == 1 else 8
    if q.is_cuda and k.dim() == 3 and q.shape[-1] % step != 0:
        # The cuda kernels take head sizes in steps of 8 (16 over fp8 k / v: whole 16-byte
        # rows): zero columns appended to q, k and v up to the next one, as FlashAttention
        # pads (the scale stays d's; the padding is sliced off the output). A paged cache is
        # the caller's and cannot be padded here.
        width = (q.shape[-1] + step - 1) // step * step
        q, k, v = (_pad_last(t, width) for t in (q, k, v))
    # Descales: fp8 only (FlashAttention 3 ignores them for 16-bit inputs).
    kv_scale = (1.0, 1.0)
    post = None
    query_quant = False
    cache_dtype = "auto"
    if fp8:
        uniform = all(_uniform(s) for s in (q_descale, k_descale, v_descale))
        if uniform:
            # One value per tensor: the vLLM drop-in's fp8 path (fp8 products on CUDA).
            q, scale, query_quant = fa._fp8_query(q, q_descale, scale, k, "auto", out, backend)
            kv_scale = (fa._host_scale(k_descale, "k_descale"),
                        fa._host_scale(v_descale, "v_descale"))
        else:
            # Per-request / per-head descales fold into a float32 query (q8 * qd * kd, one
            # float32 rounding) and the float32 output (times vd), read back in out_dtype.
            rows = row_requests(cu_q, T)
            f = torch.ones(T, H, device=q.device)
            for s, name in ((q_descale, "q_descale"), (k_descale, "k_descale")):
                if s is not None:
                    f = f * per_row_head(s, name, batch, Hk, H, rows)
            q = q.float() * f[:, :, None]
            post = per_row_head(v_descale, "v_descale", batch, Hk, H, rows)
        cache_dtype = _ops.resolve_kv_cache_dtype("auto", q, k)
    work_dtype = q.dtype  # the widened (out_dtype) or folded (float32) query's, or q's own
    if out is not None and (tuple(out.shape) != (T, H, dv) or out.dtype != out_dtype):
        raise _C.InvalidArgument(
            f"out must be {out_dtype} [{T}, {H}, {dv}]; got {out.dtype} {list(out.shape)}")
    width = v.shape[-1]
    res = torch.zeros((T, H, width), dtype=work_dtype, device=q.device)
    lse = torch.full((H, T), float("-inf"), dtype=torch.float32, device=q.device)

    direct_right = right
    if not causal and right >= 0 and right >= int(max_q) - 1:
        direct_right = -1  # every query's bound lies past its request's last key
    direct = (seqused_q is None and chunk == 0 and (causal or direct_right < 0))
    if direct and causal and q.is_cuda and alibi_slopes is None:
        # The cuda backend refuses causal requests with more queries than keys (rows that see
        # no key); virtual requests never have them, so such a batch goes that way (a sync).
        direct = not _starved(cu_q, cu_k, seqused_k)
    if direct:
        if seqused_k is None and block_table is not None:
            seqused_k = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        fa.flash_attn_varlen_func(
            q, k, v, int(max_q), cu_q, int(max_k), cu_seqlens_k=cu_k, seqused_k=seqused_k,
            softmax_scale=scale, causal=causal, window_size=(left, direct_right),
            softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
            return_softmax_lse=False, out=res, k_descale=kv_scale[0], v_descale=kv_scale[1],
            kv_cache_dtype=cache_dtype, backend=backend, _lse_out=lse,
            _query_quant=query_quant)
    else:
        if alibi_slopes is not None:
            raise _C.NotSupported(
                "alibi_slopes with a window bounded on the right inside the queries, "
                "attention_chunk or seqused_q: these go through virtual requests, whose "
                "positions ALiBi would not see")
        cu_q_h = host_ints(cu_q)
        q_lens = (host_ints(seqused_q) if seqused_q is not None
                  else [b - a for a, b in zip(cu_q_h, cu_q_h[1:])])
        if seqused_k is not None:
            k_lens = host_ints(seqused_k)
        elif cu_k is not None:
            cu_k_h = host_ints(cu_k)
            k_lens = [b - a for a, b in zip(cu_k_h, cu_k_h[1:])]
        else:
            raise _C.InvalidArgument("cu_seqlens_k or seqused_k is required")
        if block_table is None and cu_k is None:
            raise _C.InvalidArgument("cu_seqlens_k is required without a block_table")
        plans = plan_virtual(cu_q_h[:-1], q_lens, k_lens, causal, left, right, chunk)
        keys = PagedKeys(k, v, cu_k, block_table)
        attend_virtual(q, keys, plans, left, right, causal, res, lse, scale, softcap,
                       cache_dtype, kv_scale[0], kv_scale[1], backend, query_quant)
    if width != dv:
        res = res[..., :dv]
    if post is not None:
        res = res * post[:, :, None]
    if out is None:
        out = res.to(out_dtype) if res.dtype != out_dtype or not res.is_contiguous() else res
    else:
        out.copy_(res)
    return out, lse


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    """t with zero columns appended to its last dimension up to width (a copy), or t."""
    if t.shape[-1] >= width:
        return t
    zeros = torch.zeros((*t.shape[:-1], width - t.shape[-1]), dtype=t.dtype, device=t.device)
    return torch.cat((t, zeros), dim=-1)


def _starved(cu_q: torch.Tensor, cu_k: Optional[torch.Tensor],
             seqused_k: Optional[torch.Tensor]) -> bool:
    """Whether some request has more queries than keys (read on the host)."""
    k_lens = seqused_k if seqused_k is not None else (
        cu_k[1:] - cu_k[:-1] if cu_k is not None else None)
    if k_lens is None:
        return False
    q_lens = cu_q[1:] - cu_q[:-1]
    return bool((q_lens.to(k_lens.device) > k_lens).any())


def _uniform(s) -> bool:
    """True for None, a number, or a tensor holding one value everywhere."""
    if s is None or not isinstance(s, torch.Tensor):
        return True
    flat = s.detach().reshape(-1)
    return flat.numel() <= 1 or bool((flat == flat[0]).all())
