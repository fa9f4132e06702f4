"""Functional helpers over the bindings: streams, cached impls, write_kv, forward steps."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, List, Optional, Sequence, Union

from pagedattn import _C

#: A paged cache: one combined [num_blocks, 2, block_size, num_kv_heads, head_size] array or a
#: (key_cache, value_cache) pair of [num_blocks, block_size, num_kv_heads, head_size] arrays.
KVCacheArg = Union[Any, Sequence[Any]]
# A float (per tensor) or a sequence / array of floats (per head).
ScaleArg = Union[float, Sequence[float], Any]

_impls: dict[tuple, _C.Impl] = {}


def current_stream(*arrays: Any) -> int:
    """The stream pagedattn should run on for these arrays, as an integer cudaStream_t.

    torch's current stream on the device of the first CUDA torch tensor among ``arrays``
    (sequences are searched too); 0 (the legacy default stream) otherwise.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    for a in arrays:
        if isinstance(a, (tuple, list)):
            s = current_stream(*a)
            if s:
                return s
        elif isinstance(a, torch.Tensor) and a.is_cuda:
            return torch.cuda.current_stream(a.device).cuda_stream
    return 0


def _config_key(config: _C.AttentionConfig) -> tuple:
    return (
        config.num_heads,
        config.head_size,
        config.scale,
        config.num_kv_heads,
        config.sliding_window,
        config.logits_soft_cap,
        tuple(config.alibi_slopes),
        tuple(config.sinks),
        config.attn_type,
        config.dtype,
        config.kv_cache_dtype,
        config.kv_cache_layout,
        config.block_size,
        config.v_head_size,
    )


def get_impl(
    config: _C.AttentionConfig, device: Any = "cpu", backend: Optional[str] = None
) -> _C.Impl:
    """A cached :class:`Impl` for ``config`` on ``device`` (one per distinct config).

    ``backend`` (or ``$PAGEDATTN_BACKEND``) forces a backend by name; otherwise the registry's
    priority order picks the first that supports the config.
    """
    key = (_config_key(config), str(device), backend, os.environ.get("PAGEDATTN_BACKEND"))
    impl = _impls.get(key)
    if impl is None:
        impl = _C.Impl(config, device, backend)
        _impls[key] = impl
    return impl


def _option_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def configure_backend(name: str, **options: Any) -> None:
    """Sets options of the registered backend ``name``, e.g. ``configure_backend("cuda",
    prefill="all", prefill_persistent=1)`` or ``configure_backend("cpu", threads=8)``.

    The registry's backend is replaced by one with its current options and these on top
    (``Registry::configure``); values are the spellings ``get_backend(name).options()`` lists
    (``True`` / ``False`` mean ``"on"`` / ``"off"``, integers their digits). An unknown option
    or a value it does not allow raises :class:`InvalidArgument` naming both and what is
    allowed, and changes nothing. The impls cached here and by ``pagedattn.torch`` are dropped,
    so later calls build theirs with the new options; impls held elsewhere keep theirs.
    """
    _C.configure_backend(name, [f"{k}={_option_text(v)}" for k, v in options.items()])
    _impls.clear()
    ops = sys.modules.get("pagedattn.torch._ops")
    if ops is not None:
        ops._impls.clear()


def _cache_info(kv_cache: KVCacheArg) -> tuple[str, list[int], str]:
    """(dtype, [num_blocks, block_size, num_kv_heads, head_size], device) of a cache."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise _C.InvalidArgument(
                f"kv_cache must be one array or a (key_cache, value_cache) pair; got "
                f"{len(kv_cache)} items"
            )
        dtype, shape, device = _C.array_info(kv_cache[0])
        return dtype, list(shape), device
    dtype, shape, device = _C.array_info(kv_cache)
    if len(shape) != 5 or shape[1] != 2:
        raise _C.InvalidArgument(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size]; got "
            f"{dtype}{list(shape)}"
        )
    return dtype, [shape[0], shape[2], shape[3], shape[4]], device


def write_kv(
    key: Any,
    value: Any,
    slot_mapping: Any,
    kv_cache: KVCacheArg,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: ScaleArg = 1.0,
    v_scale: ScaleArg = 1.0,
    backend: Optional[str] = None,
    stream: Optional[int] = None,
) -> None:
    """Scatters new K/V rows into a paged cache (vLLM's ``reshape_and_cache_flash``).

    ``key``/``value`` are ``[num_tokens, num_kv_heads, head_size]`` (or 2-D with the heads
    flattened), ``slot_mapping`` int64 ``[num_slots]`` (token t goes to slot
    ``slot_mapping[t]``; -1 skips it; only the first num_slots rows are read). The cache is
    written in place, in either layout (strides are read). For an fp8 cache pass
    ``kv_cache_dtype='fp8'``/``'fp8_e4m3'``/``'fp8_e5m2'``: it is stored as uint8 bytes and
    written as ``saturate(x / scale)``, ``scale`` being ``k_scale`` / ``v_scale``: a float, or
    one per KV head (a sequence or 1-D array of ``num_kv_heads`` values, as vLLM's per-head
    cache quantisation). ``stream`` defaults to torch's current stream for CUDA torch tensors.
    """
    key_dtype, _, _ = _C.array_info(key)
    cache_dtype, (_, block_size, num_kv_heads, head_size), device = _cache_info(kv_cache)
    # A (key_cache, value_cache) pair may hold V of a head size of its own.
    v_head_size = (_C.array_info(kv_cache[1])[1][-1]
                   if isinstance(kv_cache, (tuple, list)) else head_size)
    if kv_cache_dtype == "auto" and cache_dtype != key_dtype:
        if cache_dtype not in ("float32", "float16", "bfloat16"):
            raise _C.InvalidArgument(
                f"kv_cache is {cache_dtype} but key is {key_dtype}; pass kv_cache_dtype "
                f"('fp8', 'fp8_e4m3' or 'fp8_e5m2' for an fp8 cache held as uint8)"
            )
        kv_cache_dtype = cache_dtype
    config = _C.AttentionConfig(
        num_heads=num_kv_heads,
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        dtype=key_dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
    )
    if v_head_size != head_size:
        config.v_head_size = v_head_size
    impl = get_impl(config, device, backend)
    if stream is None:
        stream = current_stream(key, kv_cache)
    impl.write_kv(key, value, slot_mapping, kv_cache, scale_arg(k_scale), scale_arg(v_scale),
                  stream)


def scale_arg(x: ScaleArg) -> Union[float, List[float]]:
    """A scale as Impl takes it: a float, or a flat list of floats (per head, or per request
    and head, row-major) from any sequence or array (numpy, torch; read on the host)."""
    if isinstance(x, (int, float)):
        return float(x)
    if hasattr(x, "tolist"):
        x = x.tolist()
    flat: List[float] = []

    def walk(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            for e in v:
                walk(e)
        else:
            flat.append(float(v))

    walk(x)
    return flat


def merge_attn_states(
    output: Any,
    prefix_output: Any,
    prefix_lse: Any,
    suffix_output: Any,
    suffix_lse: Any,
    output_lse: Any = None,
    *,
    backend: Optional[str] = None,
    stream: Optional[int] = None,
) -> None:
    """vLLM's ``merge_attn_states`` (spec 4.12): merges two partial attention results.

    Outputs ``[num_tokens, num_heads, head_size]``; LSEs float32 ``[num_heads, num_tokens]``
    (natural log; any infinity is read as -inf, "no keys"). Writes ``output`` and, when given,
    ``output_lse``. ``stream`` defaults to torch's current stream for CUDA torch tensors.
    """
    if stream is None:
        stream = current_stream(output)
    _C.merge_attn_states(
        output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, backend, stream
    )


@contextlib.contextmanager
def step(
    context: _C.ForwardContext,
    metadata: Union[_C.AttentionMetadata, Sequence[_C.AttentionMetadata], None],
    virtual_engine: int = 0,
) -> Iterator[_C.ForwardContext]:
    """``with pagedattn.step(ctx, metadata): layer.forward(...)``: one forward step.

    ``metadata`` is one :class:`AttentionMetadata` (or one per KV-cache group); None starts a
    profiling step, in which layers zero their output and write nothing.
    """
    if metadata is None:
        context.begin_profile_step(virtual_engine)
    else:
        context.begin_step(metadata, virtual_engine)
    try:
        yield context
    finally:
        context.end_step()
