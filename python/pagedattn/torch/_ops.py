"""The pagedattn ops registered with torch.library, each with a fake (meta) implementation.

Ops (namespace ``pagedattn``), all mutating their output arguments and returning nothing, so
that torch.compile traces them as opaque calls and CUDA graphs capture their kernels:

* ``pagedattn::write_kv``: vLLM's ``reshape_and_cache_flash``.
* ``pagedattn::attention``: paged (or, for encoder types, direct) attention over varlen batches,
  FlashAttention's ``flash_attn_varlen_func`` with a block table.
* ``pagedattn::merge_attn_states``: vLLM's ``merge_attn_states``.

Every op runs on torch's current stream of its tensors' device. Scales, ALiBi slopes and sinks
are host numbers (floats / lists), never device tensors, so that no op reads device memory on
the host (which would break CUDA-graph capture).

No ``from __future__ import annotations`` here: torch.library infers the schemas from the
annotations.
"""

import os
from typing import List, Optional, Tuple, Union

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from pagedattn import _C

_FP8_CACHE_DTYPE = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_DTYPE_NAME = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
_impls: dict = {}


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _device(t: torch.Tensor) -> str:
    return f"cuda:{t.device.index}" if t.is_cuda else "cpu"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors cross as their uint8 bytes (DLPack 0.6 has no fp8 codes)."""
    return t.view(torch.uint8) if t.dtype in _FP8_CACHE_DTYPE else t


def _dl(t: Optional[torch.Tensor]):
    """A DLPack capsule of t (None stays None). to_dlpack, unlike Tensor.__dlpack__ in some
    torch versions, never synchronises streams (which would break CUDA-graph capture) and
    accepts tensors of any CUDA device; pagedattn runs on the stream it is given."""
    return None if t is None else _to_dlpack(_bytes(t))


def _dtype_name(t: torch.Tensor) -> str:
    name = _DTYPE_NAME.get(t.dtype)
    if name is None:
        raise _C.InvalidArgument(
            f"dtype {t.dtype} is not float32, float16, bfloat16 or float64 (tensor of shape "
            f"{list(t.shape)})"
        )
    return name


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, activation: torch.Tensor, cache: torch.Tensor
) -> str:
    """vLLM's kv_cache_dtype string for a cache tensor: 'auto' is refined from the cache's
    dtype when it differs from the activations' (float8 -> fp8_e4m3 / fp8_e5m2)."""
    if kv_cache_dtype != "auto" or cache.dtype == activation.dtype:
        return kv_cache_dtype
    if cache.dtype in _FP8_CACHE_DTYPE:
        return _FP8_CACHE_DTYPE[cache.dtype]
    if cache.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return _DTYPE_NAME[cache.dtype]
    raise _C.InvalidArgument(
        f"the KV cache is {cache.dtype} but the activations are {activation.dtype}; pass "
        f"kv_cache_dtype ('fp8', 'fp8_e4m3' or 'fp8_e5m2' for an fp8 cache held as uint8)"
    )


def get_impl(
    num_heads: int,
    head_size: int,
    num_kv_heads: int,
    block_size: int,
    dtype: str,
    kv_cache_dtype: str,
    attn_type: str,
    scale: float,
    sliding_window: int,
    softcap: float,
    alibi_slopes: Optional[List[float]],
    sinks: Optional[List[float]],
    device: str,
    backend: str = "",
    query_quant: bool = False,
    v_head_size: int = 0,
) -> "_C.Impl":
    """A cached impl for one layer shape (built on first use: warm up before graph capture).
    v_head_size: V's head size where it differs from head_size (0 = the same)."""
    alibi = tuple(alibi_slopes) if alibi_slopes else ()
    sink = tuple(sinks) if sinks else ()
    if v_head_size == head_size:
        v_head_size = 0
    key = (num_heads, head_size, num_kv_heads, block_size, dtype, kv_cache_dtype, attn_type,
           scale, sliding_window, softcap, alibi, sink, device, backend, query_quant,
           v_head_size, os.environ.get("PAGEDATTN_BACKEND"))
    impl = _impls.get(key)
    if impl is None:
        config = _C.AttentionConfig(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            sliding_window=sliding_window if sliding_window > 0 else None,
            logits_soft_cap=softcap if softcap > 0 else None,
            alibi_slopes=list(alibi) or None,
            sinks=list(sink) or None,
            attn_type=attn_type,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
        )
        config.query_quant = query_quant
        config.v_head_size = v_head_size
        impl = _C.Impl(config, device, backend or None)
        _impls[key] = impl
    return impl


@torch.library.custom_op("pagedattn::write_kv", mutates_args=("key_cache", "value_cache"))
def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: float,
    v_scale: float,
    k_scales: Optional[List[float]] = None,
    v_scales: Optional[List[float]] = None,
) -> None:
    """Scatters key/value [T, num_kv_heads, head_size] into key_cache/value_cache
    [num_blocks, block_size, num_kv_heads, head_size] (any strides) at slot_mapping (int64;
    -1 skips; len(slot_mapping) tokens are written). k_scales / v_scales, when given, are the
    fp8 scales per KV head ([num_kv_heads]) and replace k_scale / v_scale."""
    if key_cache.dim() != 4:
        raise _C.InvalidArgument(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_size]; got shape "
            f"{list(key_cache.shape)}"
        )
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, key, key_cache)
    _, block_size, num_kv_heads, head_size = key_cache.shape
    impl = get_impl(num_kv_heads, head_size, num_kv_heads, block_size, _dtype_name(key),
                    cache_dtype, "decoder", 1.0, 0, 0.0, None, None, _device(key_cache),
                    v_head_size=value_cache.shape[-1] if value_cache.dim() == 4 else head_size)
    impl.write_kv(_dl(key), _dl(value), _dl(slot_mapping), (_dl(key_cache), _dl(value_cache)),
                  _scale_arg(k_scale, k_scales), _scale_arg(v_scale, v_scales),
                  _stream(key_cache))


def _scale_arg(whole: float, per_head: Optional[List[float]]) -> Union[float, List[float]]:
    """What Impl takes: the per-head list when given, else the per-tensor float."""
    return list(per_head) if per_head is not None else whole


@write_kv.register_fake
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                   v_scale, k_scales=None, v_scales=None) -> None:
    return None


@torch.library.custom_op("pagedattn::attention", mutates_args=("out", "softmax_lse"))
def attention(
    q: torch.Tensor,
    key: Optional[torch.Tensor],
    value: Optional[torch.Tensor],
    key_cache: Optional[torch.Tensor],
    value_cache: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: Optional[torch.Tensor],
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_actual_tokens: int,
    attn_type: str,
    softmax_scale: float,
    sliding_window: int,
    softcap: float,
    alibi_slopes: Optional[List[float]],
    sinks: Optional[List[float]],
    kv_cache_dtype: str,
    k_scale: float,
    v_scale: float,
    cu_seqlens_q_cpu: Optional[torch.Tensor],
    seqused_k_cpu: Optional[torch.Tensor],
    backend: str,
    query_quant: bool = False,
    q_scale: float = 1.0,
    k_scales: Optional[List[float]] = None,
    v_scales: Optional[List[float]] = None,
) -> None:
    """Attention for query rows [0, num_actual_tokens) of q [T, num_heads, head_size] into out
    [T, num_heads, v_head_size] (v_head_size: value's / value_cache's last dimension, at most
    head_size) and softmax_lse float32 [num_heads, T].

    Request r owns rows cu_seqlens_q[r]..cu_seqlens_q[r+1] and attends over seqused_k[r] keys:
    read from the paged cache through block_table (decoder: causal, bottom-right aligned;
    encoder_decoder: not causal), or from key/value directly (encoder, encoder_only).
    sliding_window counts the current token (0 = none), softcap 0 = none. num_actual_tokens -1
    reads it from cu_seqlens_q_cpu (or the CPU cu_seqlens_q), else q.shape[0]. The *_cpu
    mirrors, when given, let the backend plan the step (KV splits on CUDA) and the host check
    the metadata. backend names a backend ("" = the registry's choice). query_quant is vLLM's
    (AttentionConfig::query_quant): the query is quantised to e4m3 with q_scale and the backend
    computes with fp8 products (cuda, ref; the cpu backend refuses it with its reason).
    k_scales / v_scales, when given, replace k_scale / v_scale: [num_kv_heads] or
    [num_seqs * num_kv_heads] (row-major) fp8 scales (ref and cpu serve differing values; the
    cuda backend only equal ones, and refuses others with its reason).
    """
    cached = attn_type in ("decoder", "encoder_decoder")
    num_heads, head_size = q.shape[1], q.shape[2]
    if cached:
        if key_cache is None or value_cache is None or block_table is None:
            raise _C.InvalidArgument(
                f"{attn_type} attention reads a paged cache: key_cache, value_cache and "
                f"block_table are required"
            )
        if key_cache.dim() != 4:
            raise _C.InvalidArgument(
                f"key_cache must be [num_blocks, block_size, num_kv_heads, head_size]; got "
                f"shape {list(key_cache.shape)}"
            )
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, q, key_cache)
        kv_cache = (_dl(key_cache), _dl(value_cache))
        v_head_size = value_cache.shape[-1] if value_cache.dim() == 4 else head_size
    else:
        if key is None or value is None:
            raise _C.InvalidArgument(f"{attn_type} attention needs key and value")
        block_size, num_kv_heads = 16, key.shape[1]
        cache_dtype = "auto"
        kv_cache = None
        v_head_size = value.shape[-1] if value.dim() == 3 else head_size
    device = _device(q)
    impl = get_impl(num_heads, head_size, num_kv_heads, block_size, _dtype_name(q), cache_dtype,
                    attn_type, softmax_scale, sliding_window, softcap, alibi_slopes, sinks,
                    device, backend, query_quant, v_head_size)
    num_seqs = seqused_k.shape[0]
    host_qsl = cu_seqlens_q_cpu if cu_seqlens_q_cpu is not None else (
        cu_seqlens_q if not cu_seqlens_q.is_cuda else None)
    if num_actual_tokens < 0:
        num_actual_tokens = int(host_qsl[num_seqs]) if host_qsl is not None else q.shape[0]
    slot_mapping = None
    if cached and not q.is_cuda:
        # CPU: a no-write slot mapping lets the host check the whole metadata (block ids).
        slot_mapping = torch.full((num_actual_tokens,), -1, dtype=torch.int64)
    metadata = _C.AttentionMetadata(
        _dl(cu_seqlens_q), _dl(seqused_k), _dl(block_table), _dl(slot_mapping),
        num_seqs=num_seqs, num_actual_tokens=num_actual_tokens, max_query_len=max_seqlen_q,
        max_seq_len=max_seqlen_k, causal=attn_type == "decoder",
        query_start_loc_cpu=_dl(cu_seqlens_q_cpu), seq_lens_cpu=_dl(seqused_k_cpu))
    plan = impl.plan(metadata)
    workspace = None
    if plan.workspace_bytes > 0:
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=q.device)
    impl.forward(_dl(q), kv_cache, metadata, _dl(out), _dl(softmax_lse), _dl(key), _dl(value),
                 _scale_arg(k_scale, k_scales), _scale_arg(v_scale, v_scales), plan,
                 _dl(workspace), _stream(q), q_scale=q_scale)


@attention.register_fake
def _attention_fake(q, key, value, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table,
                    out, softmax_lse, max_seqlen_q, max_seqlen_k, num_actual_tokens, attn_type,
                    softmax_scale, sliding_window, softcap, alibi_slopes, sinks, kv_cache_dtype,
                    k_scale, v_scale, cu_seqlens_q_cpu, seqused_k_cpu, backend, query_quant=False,
                    q_scale=1.0, k_scales=None, v_scales=None) -> None:
    return None


@torch.library.custom_op("pagedattn::merge_attn_states",
                         mutates_args=("output", "output_lse"))
def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: Optional[torch.Tensor],
) -> None:
    """vLLM's merge_attn_states: outputs [N, H, D], LSEs float32 [H, N] (natural log)."""
    _C.merge_attn_states(_dl(output), _dl(prefix_output), _dl(prefix_lse), _dl(suffix_output),
                         _dl(suffix_lse), _dl(output_lse), None, _stream(output))


@merge_attn_states.register_fake
def _merge_fake(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse) -> None:
    return None


def window_to_sliding_window(window_size: Tuple[int, int], causal: bool) -> Tuple[str, int]:
    """FlashAttention's (left, right) window and causal flag -> (attn_type, sliding_window).

    causal with (-1, -1) / (W-1, 0) / (W-1, -1): a decoder with window W (0 = none); not
    causal with (-1, -1) / (W-1, -1): cross attention over the cache (left-only window).
    Anything else raises NotSupported.
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal and right in (-1, 0):
        return "decoder", left + 1 if left >= 0 else 0
    if not causal and right == -1:
        return "encoder_decoder", left + 1 if left >= 0 else 0
    raise _C.NotSupported(
        f"window_size {tuple(window_size)} with causal={causal} is not supported: pagedattn "
        f"serves causal (left, 0) windows and non-causal (left, -1) windows over a paged cache"
    )
