"""FlashAttention 3's Python interface (``hopper/flash_attn_interface.py``) over the pagedattn
ops: ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_qkvpacked_func``,
``flash_attn_with_kvcache`` and ``flash_attn_combine``, with FlashAttention 3's signatures and
return conventions. No kernels of its own: the masks the op does not serve directly (windows
bounded on the right, ``attention_chunk``, ``seqused_q``) go through _fa_common's virtual
requests. docs/python.md ("FlashAttention 2 and 3 signatures") lists the differences.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from pagedattn import _C
from pagedattn.torch import _fa_common as C
from pagedattn.torch import kvcache as _kvcache


def _hints(num_splits: int, pack_gqa: Optional[bool], sm_margin: int,
           deterministic: bool) -> None:
    """Tuning hints of FlashAttention 3's scheduler: accepted and ignored (the backend plans
    its own splits; the forward pass is deterministic either way)."""
    del num_splits, pack_gqa, sm_margin, deterministic


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Varlen attention of q ``[total_q, heads, d]`` over packed k ``[total_k, kv_heads, d]``
    and v ``[total_k, kv_heads, dv]`` (or, with ``cu_seqlens_k`` None, batched k / v
    ``[batch, seqlen_k, kv_heads, d]``).

    Request r's queries are rows ``cu_seqlens_q[r]`` onwards, ``seqused_q[r]`` of them when
    given (else up to ``cu_seqlens_q[r+1]``); its keys rows ``cu_seqlens_k[r]`` onwards,
    ``seqused_k[r]`` of them when given. Rows past ``seqused_q`` are not attended: their output
    is 0 and their LSE -inf. Masks are FlashAttention's: bottom-right causal, ``window_size``
    (left, right) around query position a = i + seqlen_k - seqlen_q, ``attention_chunk`` C
    (keys in a's chunk [a - a mod C, a - a mod C + C) only). ``qv`` [total_q, heads, dv] adds
    <qv, v> to the logits (scale default (d + dv) ** -0.5). fp8 e4m3 q/k/v read with
    ``q_descale`` / ``k_descale`` / ``v_descale`` float32 ``[batch, kv_heads]``; the output is
    bfloat16. ``num_splits``, ``pack_gqa``, ``sm_margin``, ``deterministic`` are hints.

    Returns out ``[total_q, heads, dv]``, and with ``return_attn_probs`` (FlashAttention 3's
    name for it) ``(out, softmax_lse)``, the LSE float32 ``[heads, total_q]``.
    """
    _hints(num_splits, pack_gqa, sm_margin, deterministic)
    if cu_seqlens_k is None and k.dim() == 4 and v.dim() == 4:
        # FlashAttention 3 also takes batched keys [batch, seqlen_k, kv_heads, d] here.
        sk = k.shape[1]
        cu_seqlens_k = torch.arange(k.shape[0] + 1, dtype=torch.int32, device=k.device) * sk
        k, v = k.flatten(0, 1), v.flatten(0, 1)
    out, lse = C.varlen_core(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
        seqused_k=seqused_k, scale=softmax_scale, causal=causal, window_size=window_size,
        chunk=int(attention_chunk), softcap=float(softcap or 0.0), qv=qv, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend=backend)
    out = C.no_backward(out, q, k, v, qv)
    return (out, lse) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Batched attention: q ``[batch, seqlen_q, heads, d]``, k ``[batch, seqlen_k, kv_heads,
    d]``, v ``[batch, seqlen_k, kv_heads, dv]``, as flash_attn_varlen_func with equal lengths.
    Returns out ``[batch, seqlen_q, heads, dv]`` (and the LSE ``[batch, heads, seqlen_q]`` with
    ``return_attn_probs``)."""
    qf, kf, vf, cu_q, cu_k, sq, sk = C.batched_as_varlen(q, k, v)
    b, h = q.shape[0], q.shape[2]
    out, lse = C.varlen_core(
        qf, kf, vf, cu_q, cu_k, sq, sk, scale=softmax_scale,
        causal=causal, window_size=window_size, chunk=int(attention_chunk),
        softcap=float(softcap or 0.0),
        qv=None if qv is None else qv.reshape(b * sq, h, qv.shape[3]), q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend=backend)
    _hints(num_splits, pack_gqa, sm_margin, deterministic)
    out = C.no_backward(out.view(b, sq, h, out.shape[-1]), q, k, v, qv)
    if not return_attn_probs:
        return out
    return out, lse.view(h, b, sq).transpose(0, 1).contiguous()


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    deterministic: bool = False,
    num_heads_q: Optional[int] = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """qkv ``[batch, seqlen, 3, heads, d]``, or ``[batch, seqlen, num_heads_q + 2 * kv_heads,
    d]`` with ``num_heads_q`` (GQA), split and passed to flash_attn_func."""
    if qkv.dim() == 5:
        q, k, v = C.unpack(qkv, 3, 2, "qkv", "[batch, seqlen, 3, heads, d]")
    elif qkv.dim() == 4 and num_heads_q is not None:
        hk = (qkv.shape[2] - num_heads_q) // 2
        if hk <= 0 or num_heads_q + 2 * hk != qkv.shape[2]:
            raise _C.InvalidArgument(
                f"qkv has {qkv.shape[2]} heads: not num_heads_q ({num_heads_q}) + 2 * kv_heads")
        q, k, v = qkv.split([num_heads_q, hk, hk], dim=2)
    else:
        raise _C.InvalidArgument(
            f"qkv must be [batch, seqlen, 3, heads, d], or 4-D with num_heads_q; got "
            f"{list(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale,
                           v_descale, window_size, attention_chunk, softcap, 1, None,
                           deterministic, sm_margin, return_attn_probs, backend=backend)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Union[int, torch.Tensor, None] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
    *,
    backend: str = "",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention 3's decode API as varlen attention over the cache, read through a block
    table (``page_table`` [batch, max_pages] int32 over ``[num_pages, page_size, kv_heads, d]``,
    or rows ``cache_batch_idx`` of a contiguous ``[batch_cache, seqlen_cache, kv_heads, d]``
    cache) by flash_attn_varlen_func's path: a varlen q (``cu_seqlens_q``, ``max_seqlen_q``),
    ``qv``, ``attention_chunk``, any window and fp8 descales ``[batch, kv_heads]`` as there.
    New k / v (``[batch, seqlen_new, kv_heads, d]``, or varlen with ``cu_seqlens_k_new``) are
    first written in place at positions ``cache_seqlens + i``, rotated by ``rotary_cos`` /
    ``rotary_sin`` at ``rotary_seqlens`` (default ``cache_seqlens``) + i, as is q (every query at
    the base unless causal or local). With ``cache_leftpad``, or a cache whose strides allow no
    flat view, it is pagedattn.torch.flash_attn_with_kvcache instead (``page_table`` as its
    ``block_table``; one k/v descale per tensor), which refuses ``qv``, a varlen q,
    ``cu_seqlens_k_new``, ``rotary_seqlens`` and ``attention_chunk`` with NotSupported.
    Returns out (``[batch, seqlen_q, heads, dv]``, or ``[total_q, heads, dv]`` for a varlen
    q), or ``(out, softmax_lse)`` with ``return_softmax_lse`` (``[batch, heads, seqlen_q]`` /
    ``[heads, total_q]``; FlashAttention 3 appends its split accumulators too, so
    ``out, lse, *rest = ...`` reads both)."""
    del scheduler_metadata
    _hints(num_splits, pack_gqa, sm_margin, False)
    if cache_leftpad is None and _flat_cache(k_cache) is not None and \
            _flat_cache(v_cache) is not None:
        return _cache_as_varlen(q, k_cache, v_cache, k, v, qv, rotary_cos, rotary_sin,
                                cache_seqlens, cache_batch_idx, page_table, cu_seqlens_q,
                                cu_seqlens_k_new, max_seqlen_q, rotary_seqlens, q_descale,
                                k_descale, v_descale, softmax_scale, causal, window_size,
                                int(attention_chunk), softcap, rotary_interleaved,
                                return_softmax_lse, backend)
    for value, name in ((qv, "qv"), (cu_seqlens_q, "cu_seqlens_q (a varlen q)"),
                        (cu_seqlens_k_new, "cu_seqlens_k_new"),
                        (rotary_seqlens, "rotary_seqlens")):
        if value is not None:
            raise _C.NotSupported(
                f"{name} with cache_leftpad (or a cache without a flat view) is not "
                f"supported by flash_attn_with_kvcache here")
    if attention_chunk:
        raise _C.NotSupported(
            "attention_chunk with cache_leftpad (or a cache without a flat view) is not "
            "supported by flash_attn_with_kvcache here")
    return _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, page_table, softmax_scale, causal, window_size, softcap,
        rotary_interleaved, None, 0, return_softmax_lse, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend=backend)


def _flat_cache(cache: torch.Tensor) -> Optional[torch.Tensor]:
    """The cache as [slots, kv_heads, d] sharing its memory (writes land in the cache), or None
    when its strides allow no such view."""
    if cache.dim() != 4:
        return None
    try:
        return cache.view(-1, cache.shape[2], cache.shape[3])
    except RuntimeError:
        return None


def _cache_as_varlen(q, k_cache, v_cache, k, v, qv, rotary_cos, rotary_sin, cache_seqlens,
                     cache_batch_idx, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                     rotary_seqlens, q_descale, k_descale, v_descale, softmax_scale, causal,
                     window_size, chunk, softcap, rotary_interleaved, return_softmax_lse,
                     backend):
    """flash_attn_with_kvcache as varlen attention over the cache, read through a block table
    (a contiguous cache is one block of seqlen_cache tokens per row), after new k / v are
    written at positions cache_seqlens + i (rotated first with rotary_cos / rotary_sin)."""
    dev = q.device
    varlen = cu_seqlens_q is not None
    if varlen:
        if q.dim() != 3 or max_seqlen_q is None:
            raise _C.InvalidArgument(
                "with cu_seqlens_q, q must be [total_q, heads, d] and max_seqlen_q given")
        cu_q, max_q, qf = cu_seqlens_q.to(torch.int32), int(max_seqlen_q), q
    else:
        if q.dim() != 4:
            raise _C.InvalidArgument(
                f"q must be [batch, seqlen_q, heads, d]; got shape {list(q.shape)}")
        b, sq = q.shape[0], q.shape[1]
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev) * sq
        max_q, qf = sq, q.reshape(b * sq, *q.shape[2:])
    batch = cu_q.shape[0] - 1
    bs = k_cache.shape[1]
    if page_table is not None:
        if cache_batch_idx is not None:
            raise _C.NotSupported("cache_batch_idx with a page_table (FlashAttention refuses it "
                                  "too)")
        table = page_table.to(torch.int32)
    else:
        rows = (torch.arange(batch, dtype=torch.int32, device=dev) if cache_batch_idx is None
                else cache_batch_idx.to(device=dev, dtype=torch.int32))
        table = rows[:, None]
    capacity = table.shape[1] * bs
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=dev)
    elif isinstance(cache_seqlens, int):
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=dev)
    else:
        seqlens = cache_seqlens.to(device=dev, dtype=torch.int32)
    rows_q = C.row_requests(cu_q, qf.shape[0])
    if (k is None) != (v is None):
        raise _C.InvalidArgument("k and v are given together or not at all")
    if rotary_cos is not None and k is None:
        raise _C.InvalidArgument("rotary_cos / rotary_sin rotate the new k: pass k and v")
    ro_base = (rotary_seqlens if rotary_seqlens is not None else seqlens).to(dev).long()
    if rotary_cos is not None:
        # Queries at rotary base + i when causal or local, else all at the base (FA's rule).
        local = tuple(C.window_pair(window_size)) != (-1, -1)
        i_q = torch.arange(qf.shape[0], device=dev) - cu_q.long()[rows_q]
        pos_q = ro_base[rows_q] + (i_q if causal or local else 0)
        qf = _kvcache._rotary(qf[None], rotary_cos, rotary_sin, pos_q[None], rotary_interleaved)[0]
    if k is not None:
        if cu_seqlens_k_new is not None:
            kf, vf, cu_new = k, v, cu_seqlens_k_new.to(device=dev, dtype=torch.int32)
        else:
            if k.dim() != 4 or v.dim() != 4:
                raise _C.InvalidArgument("k / v must be [batch, seqlen_new, kv_heads, d]")
            n = k.shape[1]
            kf, vf = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
            cu_new = torch.arange(batch + 1, dtype=torch.int32, device=dev) * n
        new_lens = cu_new[1:] - cu_new[:-1]
        host_end = C.host_ints(seqlens + new_lens)
        if any(e > capacity or e < 0 for e in host_end):
            raise _C.InvalidArgument(
                f"cache_seqlens + the new tokens ({host_end}) must lie in [0, {capacity}]: the "
                f"cache holds {capacity} tokens per request")
        rows_k = C.row_requests(cu_new, kf.shape[0])
        pos = seqlens.long()[rows_k] + torch.arange(kf.shape[0], device=dev) - \
            cu_new.long()[rows_k]
        if rotary_cos is not None:
            pos_ro = ro_base[rows_k] + pos - seqlens.long()[rows_k]
            kf = _kvcache._rotary(kf[None], rotary_cos, rotary_sin, pos_ro[None],
                                  rotary_interleaved)[0]
        col = (pos // bs).clamp(max=table.shape[1] - 1)
        slots = table.long()[rows_k, col] * bs + pos % bs
        _flat_cache(k_cache)[slots] = kf.to(k_cache.dtype)
        _flat_cache(v_cache)[slots] = vf.to(v_cache.dtype)
        seqlens = seqlens + new_lens
    qvf = None
    if qv is not None:
        qvf = qv if varlen else qv.reshape(qf.shape[0], *qv.shape[2:])
    out, lse = C.varlen_core(
        qf, k_cache, v_cache, cu_q, None, max_q, capacity, seqused_k=seqlens,
        block_table=table, scale=softmax_scale, causal=causal, window_size=window_size,
        chunk=chunk, softcap=float(softcap or 0.0), qv=qvf, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend=backend)
    if not varlen:
        b, sq, h = q.shape[0], q.shape[1], q.shape[2]
        out = out.view(b, sq, h, out.shape[-1])
        lse = lse.view(h, b, sq).transpose(0, 1).contiguous()
    return (out, lse) if return_softmax_lse else out


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                       out: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Merges split results: out_partial ``[splits, ..., seqlen, heads, d]`` with lse_partial
    ``[splits, ..., seqlen, heads]`` (natural log) into ``[..., seqlen, heads, d]``, in float32
    torch (spec 4.12's rule applied across splits: a split of LSE -inf weighs 0; a row whose
    splits are all -inf gives 0)."""
    lse = lse_partial.float()
    m = lse.amax(dim=0, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    total = w.sum(dim=0)
    weights = w / torch.where(total > 0, total, torch.ones_like(total))
    res = (out_partial.float() * weights.unsqueeze(-1)).sum(dim=0)
    res = res.to(out_dtype or (out.dtype if out is not None else out_partial.dtype))
    if out is not None:
        out.copy_(res)
        return out
    return res
