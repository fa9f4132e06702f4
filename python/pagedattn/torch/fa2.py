"""FlashAttention 2's Python interface (``flash_attn/flash_attn_interface.py``) over the
pagedattn ops: ``flash_attn_func``, ``flash_attn_kvpacked_func``, ``flash_attn_qkvpacked_func``,
their ``varlen`` forms (``flash_attn_varlen_func`` with ``block_table``) and
``flash_attn_with_kvcache``, with FlashAttention 2's signatures and return conventions. The
batched forms run through the varlen path; no kernels of their own. docs/python.md
("FlashAttention 2 and 3 signatures") lists the differences.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pagedattn import _C
from pagedattn.torch import _fa_common as C
from pagedattn.torch.kvcache import flash_attn_with_kvcache

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _check(dropout_p: float, return_attn_probs: bool) -> None:
    C.check_inference(dropout_p)
    if return_attn_probs:
        raise _C.NotSupported(
            "return_attn_probs: FlashAttention 2 then returns the attention probabilities "
            "(S_dmask), which pagedattn never materialises (inference only)")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    backend: str = "",
) -> torch.Tensor:
    """Varlen attention: q ``[total_q, heads, d]``; k / v packed ``[total_k, kv_heads, d]``
    delimited by ``cu_seqlens_k``, or with ``block_table`` (int32 ``[batch, max_blocks]``)
    paged caches ``[num_blocks, page_block_size, kv_heads, d]`` holding ``cu_seqlens_k[r+1] -
    cu_seqlens_k[r]`` keys per request. Causal is bottom-right aligned; ``window_size`` (left,
    right) keeps keys in [a - left, a + right] with a = i + seqlen_k - seqlen_q; ALiBi adds
    -slope * |a - j| (served where no visible key follows the query: causal, or one query per
    request). ``deterministic`` is a backward-pass hint (ignored). Returns out ``[total_q,
    heads, d]``."""
    _check(dropout_p, return_attn_probs)
    del deterministic
    out, _ = C.varlen_core(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        block_table=block_table, scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=float(softcap or 0.0), alibi_slopes=alibi_slopes, backend=backend)
    return C.no_backward(out, q, k, v)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> torch.Tensor:
    """kv ``[total_k, 2, kv_heads, d]``; otherwise flash_attn_varlen_func."""
    k, v = C.unpack(kv, 2, 1, "kv", "[total_k, 2, kv_heads, d]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  backend=backend)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> torch.Tensor:
    """qkv ``[total, 3, heads, d]`` (one set of lengths for queries and keys)."""
    q, k, v = C.unpack(qkv, 3, 1, "qkv", "[total, 3, heads, d]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  backend=backend)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> torch.Tensor:
    """Batched attention: q ``[batch, seqlen_q, heads, d]``, k / v ``[batch, seqlen_k,
    kv_heads, d]``, run as varlen requests of equal lengths. Returns ``[batch, seqlen_q, heads,
    d]``."""
    _check(dropout_p, return_attn_probs)
    qf, kf, vf, cu_q, cu_k, sq, sk = C.batched_as_varlen(q, k, v)
    out = flash_attn_varlen_func(qf, kf, vf, cu_q, cu_k, sq, sk, dropout_p, softmax_scale,
                                 causal, window_size, softcap, alibi_slopes, deterministic, False,
                                 backend=backend)
    return out.view(q.shape[0], sq, q.shape[2], out.shape[-1])


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> torch.Tensor:
    """kv ``[batch, seqlen_k, 2, kv_heads, d]``; otherwise flash_attn_func."""
    k, v = C.unpack(kv, 2, 2, "kv", "[batch, seqlen_k, 2, kv_heads, d]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, backend=backend)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "",
) -> torch.Tensor:
    """qkv ``[batch, seqlen, 3, heads, d]``; otherwise flash_attn_func."""
    q, k, v = C.unpack(qkv, 3, 2, "qkv", "[batch, seqlen, 3, heads, d]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, backend=backend)
