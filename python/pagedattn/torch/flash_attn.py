"""Drop-in replacements for vLLM's FlashAttention entry points, over the pagedattn ops.

``flash_attn_varlen_func`` has the signature of vLLM's ``vllm_flash_attn.flash_attn_varlen_func``,
``reshape_and_cache_flash`` and ``merge_attn_states`` those of ``vllm._custom_ops``;
``flash_attn_with_kvcache`` (FlashAttention's decode API) is in kvcache.py. The differences are
listed in docs/drop_ins.md.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from pagedattn import _C
from pagedattn.torch import _ops

Number = Union[float, int]
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _host_floats(x: Any, name: str) -> Optional[List[float]]:
    """None, a list of numbers, or a tensor (read on the host: a device sync) -> list."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.dim() == 2:  # FlashAttention also takes [batch, nheads]: pagedattn has per-head
            rows = x.float().cpu()
            if not bool((rows == rows[0]).all()):
                raise _C.NotSupported(f"{name} differs between requests; pagedattn takes one "
                                      f"value per head")
            x = rows[0]
        return [float(v) for v in x.detach().float().cpu().tolist()]
    return [float(v) for v in x]


def _host_scale(x: Any, name: str) -> float:
    """A scale that must be one value: a number, a one-element tensor, or a tensor holding one
    value in every element. A tensor of differing values is refused, never read as its first
    element."""
    whole, per_head = _host_scales(x, name)
    if per_head is not None:
        raise _C.NotSupported(
            f"{name} of shape {list(x.shape)} holds differing values (per-head or "
            f"per-request scales); this path takes one scale for the whole tensor")
    return whole


def _host_scales(x: Any, name: str) -> Tuple[float, Optional[List[float]]]:
    """A scale as (per-tensor float, per-head list or None): a number; a tensor holding one
    value in every element (vLLM expands a per-tensor scale to FlashAttention's [batch,
    num_kv_heads]) gives that value; a [batch, num_kv_heads] tensor whose rows are equal gives
    its first row ([num_kv_heads], per head); any other tensor its values flattened, row-major
    ([num_kv_heads], or [batch * num_kv_heads] per request and head), whose length the backend
    checks. A CUDA tensor is read on the host (a sync)."""
    if x is None:
        return 1.0, None
    if not isinstance(x, torch.Tensor):
        return float(x), None
    t = x.detach().float().cpu()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        raise _C.InvalidArgument(f"{name} is empty")
    if bool((flat == flat[0]).all()):
        return float(flat[0]), None
    if t.dim() > 2:
        raise _C.InvalidArgument(
            f"{name} must be a number, [num_kv_heads] or [batch, num_kv_heads]; got shape "
            f"{list(x.shape)}")
    if t.dim() == 2 and bool((t == t[0:1]).all()):
        return 1.0, t[0].tolist()
    return 1.0, flat.tolist()


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_k: int,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    q_v: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Optional[Sequence[int]] = None,
    softcap: float = 0.0,
    alibi_slopes: Union[torch.Tensor, Sequence[Number], None] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    return_softmax_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Union[torch.Tensor, float, None] = None,
    v_descale: Union[torch.Tensor, float, None] = None,
    num_splits: int = 0,
    fa_version: Optional[int] = None,
    s_aux: Union[torch.Tensor, Sequence[Number], None] = None,
    *,
    kv_cache_dtype: str = "auto",
    cu_seqlens_q_cpu: Optional[torch.Tensor] = None,
    seqused_k_cpu: Optional[torch.Tensor] = None,
    backend: str = "",
    _lse_out: Optional[torch.Tensor] = None,
    _query_quant: Optional[bool] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Varlen attention, paged (``block_table`` given) or over packed K/V.

    q ``[total_q, num_heads, head_size]``; with ``block_table`` (int32 ``[batch, max_blocks]``)
    k/v are caches ``[num_blocks, block_size, num_kv_heads, head_size]`` (vLLM's FA layout,
    ``kv_cache.unbind(0)`` of ``[2, num_blocks, ...]``; any strides, so HND views work too)
    and ``seqused_k`` int32 ``[batch]`` gives each request's keys; without it k/v are packed
    ``[total_k, num_kv_heads, head_size]`` delimited by ``cu_seqlens_k``.

    ``causal`` is bottom-right aligned (a query at position c_r + i sees keys <= c_r + i);
    ``window_size = (left, right)`` as in FlashAttention: ``(W - 1, 0)`` is a sliding window
    of W tokens. ``s_aux`` are per-head attention sinks (vLLM's FA3 fork). An fp8 cache is
    read through ``kv_cache_dtype`` (or its torch float8 dtype) with ``k_descale`` /
    ``v_descale`` as the per-tensor k/v scales. A float8_e4m3fn q is vLLM's fp8 query (FA3):
    its values are ``q * q_descale``; the output is then ``out``'s dtype (default bfloat16).

    pagedattn extensions (keyword-only): ``cu_seqlens_q_cpu`` / ``seqused_k_cpu`` host copies
    that let the CUDA backend plan KV splits, ``backend`` to force one by name. ``_lse_out``
    and ``_query_quant`` are for the FlashAttention 2/3 drop-ins (fa2.py, fa3.py): an LSE
    buffer to fill, and a query they already widened from fp8.

    v may have a head size of its own, ``dv <= head_size`` (FlashAttention 3's dv; vLLM's MLA
    prefill passes Q/K 192 and V 128): served by the cpu and ref backends, refused by cuda.

    Returns ``out`` (``[total_q, num_heads, dv]``), or ``(out, softmax_lse)`` with
    ``softmax_lse`` float32 ``[num_heads, total_q]`` when ``return_softmax_lse``.
    """
    if dropout_p != 0.0:
        raise _C.NotSupported(f"dropout_p ({dropout_p}) must be 0: pagedattn is inference only")
    if return_attn_probs:
        raise _C.NotSupported("return_attn_probs is not supported (inference only)")
    if q_v is not None:
        raise _C.NotSupported("q_v (a second query for MLA's value half) is not supported")
    if q.dim() != 3:
        raise _C.InvalidArgument(
            f"q must be [total_q, num_heads, head_size]; got shape {list(q.shape)}")
    attn_type, sliding_window = _ops.window_to_sliding_window(
        tuple(window_size) if window_size is not None else (-1, -1), causal)
    if alibi_slopes is not None and attn_type != "decoder" and int(max_seqlen_q) > 1:
        raise _C.NotSupported(
            "alibi_slopes with causal=False and max_seqlen_q > 1: FlashAttention biases keys "
            "after the query position by -slope * (j - i), pagedattn by +slope * (j - i)")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    query_quant = False
    if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        q, scale, query_quant = _fp8_query(q, q_descale, scale, k, kv_cache_dtype, out, backend)
    if block_table is None:
        # Packed K/V as a cache of one-token blocks: block j of request r is row
        # cu_seqlens_k[r] + j.
        if cu_seqlens_k is None:
            raise _C.InvalidArgument("cu_seqlens_k is required without a block_table")
        if k.dim() != 3:
            raise _C.InvalidArgument(
                f"k must be [total_k, num_kv_heads, head_size] without a block_table; got "
                f"shape {list(k.shape)}")
        starts = cu_seqlens_k[:-1].to(torch.int32)
        block_table = starts[:, None] + torch.arange(
            max(int(max_seqlen_k), 1), dtype=torch.int32, device=k.device)[None, :]
        block_table = block_table.clamp_(max=max(k.shape[0] - 1, 0))
        if seqused_k is None:
            seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    elif seqused_k is None:
        if cu_seqlens_k is None:
            raise _C.InvalidArgument("seqused_k (or cu_seqlens_k) is required")
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    if _query_quant is not None:
        query_quant = _query_quant
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    lse = _lse_out if _lse_out is not None else torch.empty(
        (q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    # Descales [batch, num_kv_heads] (or [num_kv_heads]) of differing values go to the backend
    # per head; those that serve them (ref, cpu) do, the others refuse with their reason.
    k_scale, k_scales = _host_scales(k_descale, "k_descale")
    v_scale, v_scales = _host_scales(v_descale, "v_descale")
    torch.ops.pagedattn.attention(
        q, None, None, k, v, cu_seqlens_q, seqused_k, block_table, out, lse,
        int(max_seqlen_q), int(max_seqlen_k), -1, attn_type, scale, sliding_window,
        float(softcap or 0.0), _host_floats(alibi_slopes, "alibi_slopes"),
        _host_floats(s_aux, "s_aux"), kv_cache_dtype, k_scale, v_scale, cu_seqlens_q_cpu,
        seqused_k_cpu, backend, query_quant, k_scales=k_scales, v_scales=v_scales)
    return (out, lse) if return_softmax_lse else out


def _fp8_query(q: torch.Tensor, q_descale: Any, scale: float, k: torch.Tensor,
               kv_cache_dtype: str, out: Optional[torch.Tensor],
               backend: str) -> Tuple[torch.Tensor, float, bool]:
    """vLLM's fp8 query (FA3): q8 float8_e4m3fn [T, H, D] whose values are q8 * q_descale.

    Returns (q, scale, query_quant): q8 widened to the output dtype, which holds every e4m3
    value exactly, and q_descale folded into the logit scale (scale * <q8 * s, k> =
    (scale * s) * <q8, k>). Over an e4m3 cache on a backend that computes query_quant (cuda:
    fp8-product kernels; ref) the layer quantises that query with q_scale 1, which gives q8
    back bit for bit; elsewhere (the cpu backend reads 16-bit queries) the widened query is
    attended as it is, the same values in 16-bit products."""
    if q.dtype != torch.float8_e4m3fn:
        raise _C.NotSupported(
            f"q of dtype {q.dtype}: fp8 queries are float8_e4m3fn (vLLM's FA3 path)")
    dtype = out.dtype if out is not None else torch.bfloat16
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise _C.InvalidArgument(f"out is {dtype}; an fp8 query's output is bf16, f16 or f32")
    descale = _host_scale(q_descale, "q_descale")
    if not descale > 0 or descale == float("inf"):
        raise _C.InvalidArgument(f"q_descale ({descale}) must be finite and > 0")
    wide = q.to(dtype)
    cache = _ops.resolve_kv_cache_dtype(kv_cache_dtype, wide, k)
    serves_quant = q.is_cuda or backend == "ref"
    return wide, scale * descale, serves_quant and cache in ("fp8", "fp8_e4m3")


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: Union[torch.Tensor, float],
    v_scale: Union[torch.Tensor, float],
) -> None:
    """vLLM's ``reshape_and_cache_flash``: key/value ``[num_tokens, num_kv_heads, head_size]``
    into key_cache/value_cache ``[num_blocks, block_size, num_kv_heads, head_size]`` (NHD or HND
    strides) at ``slot_mapping`` (int64; -1 skips). Writes ``len(slot_mapping)`` tokens.

    ``k_scale``/``v_scale`` may be floats, one-element tensors or ``[num_kv_heads]`` tensors
    (per-head scales, as vLLM's per-head KV-cache quantisation); a CUDA tensor is read on the
    host (a sync, and not capturable in a CUDA graph): pass floats there.
    """
    k, ks = _host_scales(k_scale, "k_scale")
    v, vs = _host_scales(v_scale, "v_scale")
    torch.ops.pagedattn.write_kv(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                 k, v, ks, vs)


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: Optional[torch.Tensor] = None,
    prefill_tokens_with_context: Optional[int] = None,
    output_scale: Union[torch.Tensor, float, None] = None,
) -> None:
    """vLLM's ``merge_attn_states`` (spec 4.12): outputs ``[num_tokens, num_heads, head_size]``,
    LSEs float32 ``[num_heads, num_tokens]``; writes ``output`` (and ``output_lse``).

    ``prefill_tokens_with_context`` (default: all): tokens from this index on have no prefix
    and take the suffix's output and LSE as they are. ``output_scale`` (a one-element tensor or
    a float): ``output`` is float8_e4m3fn and receives ``merged / output_scale`` saturated to
    +-448 (the merge computed in float32 torch, with the C++ kernel's rule for infinite LSEs).
    """
    n = output.shape[0]
    p = n if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    if not 0 <= p <= n:
        raise _C.InvalidArgument(
            f"prefill_tokens_with_context ({p}) must lie in [0, num_tokens={n}]")
    if output_scale is None:
        if output.dtype == torch.float8_e4m3fn:
            raise _C.InvalidArgument("output is float8_e4m3fn: pass output_scale")
        if p > 0:
            torch.ops.pagedattn.merge_attn_states(
                output[:p], prefix_output[:p], prefix_lse[:, :p], suffix_output[:p],
                suffix_lse[:, :p], output_lse[:, :p] if output_lse is not None else None)
    else:
        if output.dtype != torch.float8_e4m3fn:
            raise _C.InvalidArgument(
                f"output_scale quantises the output to float8_e4m3fn; output is {output.dtype}")
        if output.shape != prefix_output.shape or output.shape != suffix_output.shape:
            raise _C.InvalidArgument(
                f"output {list(output.shape)}, prefix_output {list(prefix_output.shape)} and "
                f"suffix_output {list(suffix_output.shape)} must have one shape")
        inv = _inverse_scale(output_scale, output.device)
        merged = suffix_output.float()  # [N, H, D]
        if p > 0:
            head, lse = _merge_float32(prefix_output[:p], prefix_lse[:, :p], suffix_output[:p],
                                       suffix_lse[:, :p])
            merged = torch.cat((head, merged[p:]))
            if output_lse is not None:
                output_lse[:, :p] = lse
        output.copy_((merged * inv).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn))
    if p < n:
        if output_scale is None:
            output[p:] = suffix_output[p:]
        if output_lse is not None:
            output_lse[:, p:] = suffix_lse[:, p:]


def _inverse_scale(scale: Union[torch.Tensor, float], device: torch.device) -> torch.Tensor:
    """1 / scale in float32 as a one-element tensor (a device tensor stays on the device)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise _C.NotSupported(
                f"output_scale of shape {list(scale.shape)}: one per-tensor scale is supported")
        return 1.0 / scale.reshape(1).float().to(device)
    return 1.0 / torch.tensor([float(scale)], dtype=torch.float32, device=device)


def _merge_float32(po: torch.Tensor, pl: torch.Tensor, so: torch.Tensor,
                   sl: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The merge of spec 4.12 in float32 torch: (out [N, H, D], lse [H, N]). An infinite LSE
    reads as -inf; a row with both sides empty takes the prefix output and LSE -inf."""
    neg_inf = torch.tensor(float("-inf"), device=pl.device)
    p = torch.where(torch.isinf(pl), neg_inf, pl.float())
    s = torch.where(torch.isinf(sl), neg_inf, sl.float())
    m = torch.maximum(p, s)
    empty = torch.isinf(m)
    m0 = torch.where(empty, torch.zeros_like(m), m)
    wp, ws = torch.exp(p - m0), torch.exp(s - m0)
    total = wp + ws
    safe = torch.where(empty, torch.ones_like(total), total)
    scale_p = (wp / safe).T.unsqueeze(-1)  # [N, H, 1]
    scale_s = (ws / safe).T.unsqueeze(-1)
    out = po.float() * scale_p + so.float() * scale_s
    out = torch.where(empty.T.unsqueeze(-1), po.float(), out)
    return out, torch.where(empty, neg_inf, torch.log(safe) + m0)
