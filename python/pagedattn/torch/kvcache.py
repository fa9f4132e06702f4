"""FlashAttention's ``flash_attn_with_kvcache`` over the pagedattn ops.

New keys/values are appended into the cache by ``pagedattn::write_kv`` (in place, as
FlashAttention does), then ``pagedattn::attention`` reads every key through a block table. A
contiguous cache ``[batch_cache, seqlen_cache, ...]`` is a paged cache of one block per row
(page size ``seqlen_cache``); with ``cache_leftpad`` it is read as one-token pages so that each
row's keys can start past its padding. The differences from FlashAttention are listed in
docs/drop_ins.md.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from pagedattn import _C
from pagedattn.torch import _ops
from pagedattn.torch.flash_attn import _fp8_query, _host_scales

Number = Union[float, int]
_INDEX_DTYPES = (torch.int32, torch.int64)


def _index_tensor(x: torch.Tensor, name: str, batch: int, device: torch.device) -> torch.Tensor:
    """An int32 [batch] tensor on device (FlashAttention's index arguments)."""
    if x.dtype not in _INDEX_DTYPES or x.dim() != 1 or x.shape[0] != batch:
        raise _C.InvalidArgument(
            f"{name} must be an int32 [batch={batch}] tensor; got {x.dtype} of shape "
            f"{list(x.shape)}")
    if x.device != device:
        raise _C.InvalidArgument(f"{name} is on {x.device}; q is on {device}")
    return x.to(torch.int32)


def _host_values(x: Optional[torch.Tensor]) -> Optional[List[int]]:
    """The values of a CPU index tensor (None for a device tensor: reading it would sync)."""
    if x is None or x.is_cuda:
        return None
    return [int(v) for v in x.tolist()]


def _require(ok: torch.Tensor, host_ok: Optional[bool], message: str) -> None:
    """Raises InvalidArgument when a bound is broken: on the host where the values are there,
    else as a device-side assertion (no host sync; a CUDA error names the message)."""
    if host_ok is not None:
        if not host_ok:
            raise _C.InvalidArgument(message)
    else:
        torch._assert_async(ok.all(), message)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    """x [b, s, h, d] rotated at positions pos (long [b, s]) by cos/sin [seqlen_ro, rd / 2] over
    its first rd dims, in float32 (pairs (2i, 2i+1) when interleaved, else (i, i + rd/2))."""
    half = cos.shape[1]
    c = cos[pos].float().unsqueeze(2)  # [b, s, 1, rd/2]
    s = sin[pos].float().unsqueeze(2)
    head = x[..., :2 * half].float()  # [b, s, h, rd]
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., :half], head[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _alibi_rows(alibi_slopes, batch: int, nheads: int) -> Optional[List[List[float]]]:
    """ALiBi slopes [nheads] or [batch, nheads] as one list per request (host values)."""
    if alibi_slopes is None:
        return None
    t = torch.as_tensor(alibi_slopes).detach().float().cpu()
    if t.dim() == 1:
        t = t.unsqueeze(0).expand(batch, -1)
    if t.dim() != 2 or t.shape[0] != batch or t.shape[1] != nheads:
        raise _C.InvalidArgument(
            f"alibi_slopes must be [nheads={nheads}] or [batch={batch}, nheads={nheads}]; got "
            f"shape {list(t.shape)}")
    return [[float(v) for v in row] for row in t.tolist()]


def _attn_type(window_size: Sequence[int], causal: bool, seqlen_q: int, capacity: int,
               alibi: bool) -> Tuple[str, int, bool]:
    """FlashAttention's (causal, window) for seqlen_q queries per request -> (attn_type,
    sliding_window, rotate_per_token). Queries are bottom-right aligned: query i sits at
    a = i + seqlen_k - seqlen_q and sees keys a - left <= j <= a + right."""
    left, right = int(window_size[0]), int(window_size[1])
    left = -1 if left >= capacity else left  # wider than any row: no bound (as FlashAttention)
    right = -1 if right >= capacity else right
    per_token = causal or left >= 0 or right >= 0  # FlashAttention's rotary positions for q
    if causal:
        right = 0
    if right >= seqlen_q - 1:
        right = -1  # no key lies past the last query's position
    window = left + 1 if left >= 0 else 0
    if right == -1:
        if alibi and seqlen_q > 1:
            raise _C.NotSupported(
                "alibi_slopes with causal=False and seqlen_q > 1: FlashAttention biases keys "
                "after the query position by -slope * (j - i), pagedattn by +slope * (j - i); "
                "pass causal=True or one query per request")
        # Not causal: cross attention over the cache (a row may see no key: output 0).
        return "encoder_decoder", window, per_token
    if right == 0:
        return "decoder", window, per_token
    raise _C.NotSupported(
        f"window_size {tuple(window_size)} with causal={causal} and seqlen_q={seqlen_q}: "
        f"pagedattn serves a right bound of 0 (causal) or none (>= seqlen_q - 1 or -1)")


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Union[int, torch.Tensor, None] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Union[torch.Tensor, Sequence[Number], None] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    kv_cache_dtype: str = "auto",
    k_descale: Union[torch.Tensor, float, None] = None,
    v_descale: Union[torch.Tensor, float, None] = None,
    backend: str = "",
    out: Optional[torch.Tensor] = None,
    q_descale: Union[torch.Tensor, float, None] = None,
    fa_version: Optional[int] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention 2's decode entry point: attention of q over a KV cache, after appending
    the new k/v into it at ``cache_seqlens`` (in place).

    q ``[batch, seqlen_q, nheads, d]``; k_cache / v_cache paged ``[num_blocks, page_block_size,
    nheads_k, d]`` with ``block_table`` int32 ``[batch, max_blocks]``, or contiguous
    ``[batch_cache, seqlen_cache, nheads_k, d]`` (rows picked by ``cache_batch_idx`` int32
    ``[batch]``, default 0..batch-1; keys from ``cache_leftpad[b]`` on). ``cache_seqlens``: the
    keys already cached per request (int or int32 ``[batch]``; None: the whole cache). k / v
    ``[batch, seqlen_new, nheads_k, d]`` are written at positions ``cache_seqlens + i`` and
    attended. ``rotary_cos`` / ``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]`` rotate q and the
    new k first (positions ``cache_seqlens + i``; every query at ``cache_seqlens`` when neither
    causal nor local). ``causal`` is bottom-right aligned; ``window_size = (left, right)``.
    ``num_splits`` is a tuning hint (the backend plans its own splits).

    pagedattn extensions (keyword-only): ``kv_cache_dtype`` and ``k_descale`` / ``v_descale``
    for an fp8 cache, ``backend`` to force one. vLLM's fork adds (keyword-only) ``out`` (written
    and returned), ``q_descale`` for a float8_e4m3fn q (its values are ``q * q_descale``; the
    output is then ``out``'s dtype, bfloat16 without ``out``), ``fa_version`` and
    ``scheduler_metadata`` (accepted and ignored: one implementation, its own planning).

    Returns out ``[batch, seqlen_q, nheads, d]``, and with ``return_softmax_lse`` also the LSE
    float32 ``[batch, nheads, seqlen_q]`` (natural log; -inf for a query that sees no key).
    """
    del num_splits, fa_version, scheduler_metadata  # hints; the backend plans its own splits
    if q.dim() != 4:
        raise _C.InvalidArgument(
            f"q must be [batch, seqlen_q, nheads, headdim]; got shape {list(q.shape)}")
    batch, seqlen_q, nheads, d = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise _C.InvalidArgument(
            f"k_cache and v_cache must be 4-D of one shape; got {list(k_cache.shape)} and "
            f"{list(v_cache.shape)}")
    if k_cache.shape[3] != d:
        raise _C.InvalidArgument(f"k_cache head size {k_cache.shape[3]} differs from q's ({d})")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise _C.InvalidArgument(f"k_cache / v_cache are on {k_cache.device}; q on {q.device}")
    nheads_k = k_cache.shape[2]
    if nheads % nheads_k != 0:
        raise _C.InvalidArgument(
            f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    query_quant = False
    fp8_scale = 1.0
    if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        # vLLM's fp8 query (FA3): widened exactly to the output dtype, q_descale folded into
        # the logit scale (flash_attn._fp8_query).
        if k is not None or rotary_cos is not None:
            raise _C.NotSupported("an fp8 q with new k / v or rotary is not supported")
        q, fp8_scale, query_quant = _fp8_query(q, q_descale, 1.0, k_cache, kv_cache_dtype, out,
                                               backend)
    cache_dtype = _ops.resolve_kv_cache_dtype(kv_cache_dtype, q, k_cache)
    dev = q.device
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise _C.NotSupported(
                "cache_batch_idx and cache_leftpad index a contiguous cache; with a block_table "
                "each request's blocks are its own (as in FlashAttention)")
        if (block_table.dtype != torch.int32 or block_table.dim() != 2
                or block_table.shape[0] != batch):
            raise _C.InvalidArgument(
                f"block_table must be int32 [batch={batch}, max_blocks]; got {block_table.dtype} "
                f"of shape {list(block_table.shape)}")
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        page = capacity = k_cache.shape[1]
        rows = (torch.arange(batch, dtype=torch.int32, device=dev) if cache_batch_idx is None
                else _index_tensor(cache_batch_idx, "cache_batch_idx", batch, dev))
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise _C.InvalidArgument(
                f"k_cache holds {k_cache.shape[0]} rows for a batch of {batch} (pass "
                f"cache_batch_idx to pick rows)")
        host_rows = _host_values(rows)
        _require((rows >= 0) & (rows < k_cache.shape[0]),
                 None if host_rows is None else all(0 <= r < k_cache.shape[0] for r in host_rows),
                 f"cache_batch_idx must lie in [0, {k_cache.shape[0]}) (k_cache rows)")

    # The keys cached per request before this call.
    if cache_seqlens is None:
        if k is not None:
            raise _C.InvalidArgument("cache_seqlens is required to append k / v")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        host_seq = [int(cache_seqlens)] * batch
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=dev)
    else:
        seqlens = _index_tensor(cache_seqlens, "cache_seqlens", batch, dev)
        host_seq = _host_values(seqlens)
    leftpad = None
    host_pad: Optional[List[int]] = [0] * batch
    if cache_leftpad is not None:
        leftpad = _index_tensor(cache_leftpad, "cache_leftpad", batch, dev)
        host_pad = _host_values(leftpad)
        _require((leftpad >= 0) & (leftpad <= seqlens),
                 None if host_pad is None or host_seq is None else all(
                     0 <= p <= s for p, s in zip(host_pad, host_seq)),
                 "cache_leftpad must lie in [0, cache_seqlens]")

    seqlen_new = 0
    if (k is None) != (v is None):
        raise _C.InvalidArgument("k and v are given together or not at all")
    if k is not None:
        seqlen_new = k.shape[1] if k.dim() == 4 else -1
        want = [batch, seqlen_new, nheads_k, d]
        for t, name in ((k, "k"), (v, "v")):
            if t.dim() != 4 or list(t.shape) != want:
                raise _C.InvalidArgument(
                    f"{name} must be [batch={batch}, seqlen_new, nheads_k={nheads_k}, "
                    f"headdim={d}] like k; got shape {list(t.shape)}")
            if t.dtype != q.dtype or t.device != dev:
                raise _C.InvalidArgument(
                    f"{name} is {t.dtype} on {t.device}; q is {q.dtype} on {dev}")
    _require((seqlens >= 0) & (seqlens + seqlen_new <= capacity),
             None if host_seq is None else all(0 <= s <= capacity - seqlen_new
                                               for s in host_seq),
             f"cache_seqlens + seqlen_new ({seqlen_new}) must lie in [0, {capacity}]: the cache "
             f"holds {capacity} tokens per request")

    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None or rotary_cos.shape != rotary_sin.shape:
            raise _C.InvalidArgument("rotary_cos and rotary_sin go together, of one shape")
        if k is None:
            raise _C.InvalidArgument("rotary_cos / rotary_sin rotate the new k: pass k and v")
        if rotary_cos.dim() != 2 or not 0 < 2 * rotary_cos.shape[1] <= d:
            raise _C.InvalidArgument(
                f"rotary_cos must be [seqlen_ro, rotary_dim / 2] with rotary_dim <= headdim "
                f"({d}); got shape {list(rotary_cos.shape)}")
    attn_type, window, per_token = _attn_type(window_size, causal, seqlen_q, capacity,
                                              alibi_slopes is not None)

    if rotary_cos is not None:
        seqlen_ro = rotary_cos.shape[0]
        last_q = seqlen_q if per_token else 1
        _require(seqlens + max(seqlen_new, last_q) <= seqlen_ro,
                 None if host_seq is None else all(s + max(seqlen_new, last_q) <= seqlen_ro
                                                   for s in host_seq),
                 f"rotary_cos has {seqlen_ro} positions; cache_seqlens + max(seqlen_new, "
                 f"seqlen_q) must not exceed that")
        base = seqlens.long()[:, None]
        q_pos = base + (torch.arange(seqlen_q, device=dev)[None, :] if per_token else 0)
        q_pos = q_pos.expand(batch, seqlen_q).clamp(max=seqlen_ro - 1)
        k_pos = (base + torch.arange(seqlen_new, device=dev)[None, :]).clamp(max=seqlen_ro - 1)
        q = _rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        k = _rotary(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)

    # Per-head descales ([num_kv_heads], or [batch, num_kv_heads] rows) serve the write and the
    # attention; per-request ones only the attention (write_kv refuses them with its reason).
    k_scale, k_scales = _host_scales(k_descale, "k_descale")
    v_scale, v_scales = _host_scales(v_descale, "v_descale")
    if k is not None and seqlen_new > 0:
        pos = seqlens.long()[:, None] + torch.arange(seqlen_new, device=dev)[None, :]  # [b, new]
        if paged:
            col = (pos // page).clamp(max=block_table.shape[1] - 1)
            slots = block_table.long().gather(1, col) * page + pos % page
        else:
            slots = rows.long()[:, None] * capacity + pos
        torch.ops.pagedattn.write_kv(
            k.reshape(-1, nheads_k, d), v.reshape(-1, nheads_k, d), k_cache, v_cache,
            slots.reshape(-1), cache_dtype, k_scale, v_scale, k_scales, v_scales)

    # Keys attended per request, and the block table that reads them.
    seq_k = seqlens + seqlen_new
    key_cache, value_cache = k_cache, v_cache
    if paged:
        table = block_table
    elif leftpad is None:
        table = rows[:, None]  # one block of seqlen_cache tokens per request
    else:
        seq_k = seq_k - leftpad
        # One-token pages: the row's keys start at its padding (a copy if the strides forbid a
        # view; it is read after the write, so it holds the new keys too).
        key_cache = k_cache.flatten(0, 1).unsqueeze(1)
        value_cache = v_cache.flatten(0, 1).unsqueeze(1)
        table = (rows[:, None] * capacity + leftpad[:, None]
                 + torch.arange(max(capacity, 1), dtype=torch.int32, device=dev)[None, :])
        table = table.clamp(max=key_cache.shape[0] - 1).to(torch.int32)
    host_k = None
    if host_seq is not None and host_pad is not None:
        host_k = [s + seqlen_new - p for s, p in zip(host_seq, host_pad)]

    qf = q.reshape(batch * seqlen_q, nheads, d)
    user_out = out
    scale = (float(softmax_scale) if softmax_scale is not None else d ** -0.5) * fp8_scale
    slopes = _alibi_rows(alibi_slopes, batch, nheads)
    per_request = slopes is not None and any(row != slopes[0] for row in slopes)
    # A causal query sees no key when its request has fewer keys than queries (output 0):
    # those rows are left out of the call, which needs the key counts on the host.
    may_starve = attn_type == "decoder" and seqlen_new < seqlen_q
    if may_starve and host_k is None:
        host_k = [int(x) for x in seq_k.tolist()]  # a device sync, only for this case
    starved = may_starve and min(host_k) < seqlen_q

    call = dict(key_cache=key_cache, value_cache=value_cache, table=table, seq_k=seq_k,
                attn_type=attn_type, scale=scale, window=window, softcap=float(softcap or 0.0),
                cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale, k_scales=k_scales,
                v_scales=v_scales, backend=backend, query_quant=query_quant)
    if not (starved or per_request):
        out = torch.empty_like(qf)
        lse = torch.empty((nheads, batch * seqlen_q), dtype=torch.float32, device=dev)
        counts = [seqlen_q] * batch
        _attend(qf, out, lse, counts, host_k, slopes[0] if slopes else None, **call)
    else:
        out = torch.zeros_like(qf)
        lse = torch.full((nheads, batch * seqlen_q), float("-inf"), dtype=torch.float32,
                         device=dev)
        counts = [min(seqlen_q, n) if starved else seqlen_q for n in host_k or [seqlen_q] * batch]
        groups = [[r] for r in range(batch)] if per_request else [list(range(batch))]
        for reqs in groups:
            idx = torch.cat([torch.arange(r * seqlen_q + seqlen_q - counts[r],
                                          (r + 1) * seqlen_q, device=dev) for r in reqs])
            if idx.numel() == 0:
                continue
            sel = torch.tensor(reqs, dtype=torch.long, device=dev)
            o = torch.empty((idx.numel(), nheads, d), dtype=q.dtype, device=dev)
            l_ = torch.empty((nheads, idx.numel()), dtype=torch.float32, device=dev)
            sub = dict(call, table=table[sel], seq_k=seq_k[sel],
                       k_scales=_scale_rows(k_scales, reqs, batch, nheads_k),
                       v_scales=_scale_rows(v_scales, reqs, batch, nheads_k))
            _attend(qf[idx], o, l_, [counts[r] for r in reqs],
                    None if host_k is None else [host_k[r] for r in reqs],
                    slopes[reqs[0]] if slopes else None, **sub)
            out[idx] = o
            lse[:, idx] = l_
    res = out.view(batch, seqlen_q, nheads, d)
    if user_out is not None:
        if tuple(user_out.shape) != tuple(res.shape) or user_out.dtype != res.dtype:
            raise _C.InvalidArgument(
                f"out must be {res.dtype} {list(res.shape)}; got {user_out.dtype} "
                f"{list(user_out.shape)}")
        user_out.copy_(res)
        res = user_out
    if not return_softmax_lse:
        return res
    return res, lse.view(nheads, batch, seqlen_q).transpose(0, 1).contiguous()


def _scale_rows(scales: Optional[List[float]], reqs: List[int], batch: int,
                kv_heads: int) -> Optional[List[float]]:
    """Per-request scales ([batch * kv_heads]) of the requests `reqs`; others as they are."""
    if scales is None or len(scales) != batch * kv_heads or batch == 1:
        return scales
    return [scales[r * kv_heads + h] for r in reqs for h in range(kv_heads)]


def _attend(qf: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, counts: List[int],
            host_k: Optional[List[int]], slopes: Optional[List[float]], *,
            key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
            seq_k: torch.Tensor, attn_type: str, scale: float, window: int, softcap: float,
            cache_dtype: str, k_scale: float, v_scale: float, backend: str,
            k_scales: Optional[List[float]] = None,
            v_scales: Optional[List[float]] = None, query_quant: bool = False) -> None:
    """One pagedattn::attention call: qf [sum(counts), nheads, d], the rows of requests with
    counts[r] queries and seq_k[r] keys read through table [requests, columns]."""
    dev = qf.device
    cu_host = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if all(c == counts[0] for c in counts):
        # Built on the device: no host-to-device copy (capturable in a CUDA graph).
        cu = torch.arange(len(counts) + 1, dtype=torch.int32, device=dev) * counts[0]
    else:
        cu = cu_host.to(dev)
    on_cuda = dev.type == "cuda"
    seq_k_cpu = torch.tensor(host_k, dtype=torch.int32) if host_k is not None else None
    max_k = max(host_k) if host_k else table.shape[1] * key_cache.shape[1]
    torch.ops.pagedattn.attention(
        qf, None, None, key_cache, value_cache, cu, seq_k, table, out, lse, max(counts),
        max(max_k, 1), int(cu_host[-1]), attn_type, scale, window, softcap, slopes, None,
        cache_dtype, k_scale, v_scale, cu_host if on_cuda else None,
        seq_k_cpu if on_cuda else None, backend, query_quant, k_scales=k_scales,
        v_scales=v_scales)
