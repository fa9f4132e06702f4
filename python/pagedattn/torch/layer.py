"""The ``Attention`` nn.Module (vLLM's constructor), its forward context and step metadata.

The module keeps vLLM's contract: layers register under a unique ``prefix`` in a forward
context; ``with set_forward_context(metadata): model(...)`` provides one step's metadata (one
:class:`AttentionMetadata` for every layer, a dict keyed by layer name, or None for a profiling
run); ``forward(query, key, value)`` writes the new K/V into the layer's paged cache and attends
over it, through the ``pagedattn::write_kv`` and ``pagedattn::attention`` ops.

Construction goes through the C++ layer (validation, backend selection with reasons, KV-sharing
checks, cache spec, checkpoint scales); forward calls the ops on torch's current stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

import pagedattn
from pagedattn import _C

KVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class AttentionMetadata:
    """One step's metadata as torch tensors (vLLM's CommonAttentionMetadata).

    Tensors live on the compute device; the optional ``*_cpu`` host copies let the CUDA backend
    plan KV splits. For CUDA graphs keep the tensors at fixed addresses and copy each step's
    values into them (pad with zero-length requests and -1 slots).
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_slots]; -1 = not written
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    query_start_loc_cpu: Optional[torch.Tensor] = None  # int32 [num_seqs + 1], host
    seq_lens_cpu: Optional[torch.Tensor] = None  # int32 [num_seqs], host

    @classmethod
    def from_step(cls, step: _C.StepMetadata, device: Any = "cpu") -> "AttentionMetadata":
        """The tensors of a :class:`pagedattn.StepMetadata` (MetadataBuilder) on ``device``."""
        qsl = torch.from_numpy(step.query_start_loc.copy())
        seq_lens = torch.from_numpy(step.seq_lens.copy())
        device = torch.device(device)
        return cls(
            query_start_loc=qsl.to(device),
            seq_lens=seq_lens.to(device),
            block_table=torch.from_numpy(step.block_table.copy()).to(device),
            slot_mapping=torch.from_numpy(step.slot_mapping.copy()).to(device),
            num_actual_tokens=int(step.num_actual_tokens),
            max_query_len=int(step.max_query_len),
            max_seq_len=int(step.max_seq_len),
            causal=bool(step.causal),
            query_start_loc_cpu=qsl if device.type != "cpu" else None,
            seq_lens_cpu=seq_lens if device.type != "cpu" else None,
        )


class ForwardContext:
    """Layers by name (the static context) and the current step's metadata.

    One process-wide default (:func:`get_forward_context`) serves models the vLLM way; pass
    ``context=`` to a layer to keep several models apart.
    """

    def __init__(self, pipeline_parallel_size: int = 1) -> None:
        self.native = _C.ForwardContext(pipeline_parallel_size)
        self.layers: "weakref.WeakValueDictionary[str, Attention]" = weakref.WeakValueDictionary()
        self.attn_metadata: Union[AttentionMetadata, Dict[str, AttentionMetadata], None] = None
        self.virtual_engine = 0
        self.in_step = False

    @property
    def pipeline_parallel_size(self) -> int:
        return self.native.pipeline_parallel_size

    def metadata_for(self, layer_name: str) -> Optional[AttentionMetadata]:
        """The metadata of ``layer_name`` in this step (None: a profiling run)."""
        if not self.in_step:
            raise RuntimeError(
                "no forward context is set: run the model inside "
                "pagedattn.torch.set_forward_context(attn_metadata)")
        md = self.attn_metadata
        if isinstance(md, dict):
            if layer_name not in md:
                raise _C.InvalidArgument(f"the step's metadata has no entry for layer {layer_name}")
            return md[layer_name]
        return md


_default_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    """The process-wide default forward context."""
    return _default_context


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Union[AttentionMetadata, Dict[str, AttentionMetadata], None],
    virtual_engine: int = 0,
    context: Optional[ForwardContext] = None,
) -> Iterator[ForwardContext]:
    """Provides one step's metadata to every layer of ``context`` (default: the global one)."""
    ctx = context if context is not None else _default_context
    if ctx.in_step:
        raise RuntimeError("a forward context is already set (steps do not nest)")
    ctx.attn_metadata, ctx.virtual_engine, ctx.in_step = attn_metadata, virtual_engine, True
    try:
        yield ctx
    finally:
        ctx.attn_metadata, ctx.virtual_engine, ctx.in_step = None, 0, False


def _default_device() -> str:
    return "cuda" if pagedattn.with_cuda and torch.cuda.is_available() else "cpu"


def _floats(x: Any) -> Optional[List[float]]:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [float(v) for v in x.detach().float().cpu().tolist()]
    return [float(v) for v in x]


class Attention(torch.nn.Module):
    """vLLM's ``Attention`` layer as an ``nn.Module`` over the pagedattn ops.

    Arguments are vLLM's (``quant_config`` is replaced by ``has_checkpoint_kv_scales`` and
    :meth:`load_kv_scales`); ``dtype`` is the activation dtype (default: torch's default
    dtype) and ``device`` the device backends are selected for (default: cuda when available).
    ``quantize_query`` is vLLM's ``query_quant``: with an fp8 e4m3 cache the query is quantised
    to e4m3 with the layer's ``q_scale`` and the cuda backend computes in fp8.
    A layer whose ``num_heads`` is not a multiple of ``num_kv_heads`` raises
    :class:`pagedattn.InvalidArgument` (vLLM asserts).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[Sequence[float]] = None,
        cache_config: Optional[_C.CacheConfig] = None,
        logits_soft_cap: Optional[float] = None,
        per_layer_sliding_window: Optional[int] = None,
        prefix: str = "",
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: Optional[str] = None,
        attn_backend: Optional[str] = None,
        sinks: Union[torch.Tensor, Sequence[float], None] = None,
        *,
        dtype: Optional[torch.dtype] = None,
        device: Any = None,
        has_checkpoint_kv_scales: bool = False,
        quantize_query: bool = False,
        context: Optional[ForwardContext] = None,
    ) -> None:
        super().__init__()
        self._context = context if context is not None else _default_context
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        device = str(device) if device is not None else _default_device()
        self.native = _C.Attention(
            self._context.native, num_heads, head_size, float(scale), num_kv_heads,
            _floats(alibi_slopes), cache_config, logits_soft_cap, per_layer_sliding_window,
            prefix, attn_type, kv_sharing_target_layer_name, attn_backend, _floats(sinks),
            str(dtype), device, has_checkpoint_kv_scales, quantize_query)
        config = self.native.config
        self.layer_name = prefix
        self.num_heads, self.head_size = config.num_heads, config.head_size
        self.num_kv_heads = config.num_kv_heads
        self.scale = config.scale
        self.attn_type = config.attn_type
        self.sliding_window = config.sliding_window
        self.logits_soft_cap = config.logits_soft_cap
        self.kv_cache_dtype = config.kv_cache_dtype
        self.query_quant = config.query_quant
        self.alibi_slopes = list(config.alibi_slopes) or None
        self.sinks = sinks  # a parameter the model loads; re-read by process_weights_after_loading
        self._sinks_list = list(config.sinks) or None
        self._backend_name = attn_backend or ""
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache: List[Optional[KVCache]] = [None] * self._context.pipeline_parallel_size
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self._k_scales: Optional[List[float]] = None  # per KV head, when loaded so
        self._v_scales: Optional[List[float]] = None
        self.calculate_kv_scales = self.native.calculate_kv_scales
        self._context.layers[prefix] = self

    # vLLM's layer API -------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return self.native.extra_repr()

    @property
    def backend(self) -> _C.Backend:
        """The backend selected at construction (for ``device``)."""
        return self.native.backend

    def get_kv_cache_spec(self) -> Optional[_C.KVCacheSpec]:
        return self.native.get_kv_cache_spec()

    def bind_kv_cache(self, kv_caches: Sequence[KVCache]) -> None:
        """One cache per virtual engine: a ``[num_blocks, 2, block_size, num_kv_heads,
        head_size]`` tensor (see :func:`allocate_kv_cache`) or a ``(key_cache, value_cache)``
        pair of ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors."""
        if self.kv_sharing_target_layer_name is not None:
            raise _C.InvalidArgument(
                f"layer {self.layer_name} shares the KV cache of "
                f"{self.kv_sharing_target_layer_name}; bind the cache to that layer instead")
        if len(kv_caches) != self._context.pipeline_parallel_size:
            raise _C.InvalidArgument(
                f"layer {self.layer_name}: got {len(kv_caches)} KV caches; expected one per "
                f"virtual engine ({self._context.pipeline_parallel_size})")
        self.kv_cache = list(kv_caches)

    def load_kv_scales(self, q_scale: Any, k_scale: Any, v_scale: Any) -> None:
        """Checkpoint scales after weight loading (negative = absent), with vLLM's rules: floats,
        or lists of num_kv_heads floats per head (an empty list = absent)."""
        from pagedattn._functional import scale_arg
        args = [scale_arg(x) for x in (q_scale, k_scale, v_scale)]
        if any(isinstance(a, list) for a in args):  # per head: floats become absent or [x]*H
            args = [a if isinstance(a, list) else ([] if a < 0 else [a] * self.num_kv_heads)
                    for a in args]
        self.native.load_kv_scales(*args)
        self._read_native_scales()
        self.calculate_kv_scales = self.native.calculate_kv_scales

    def process_weights_after_loading(self, act_dtype: Optional[torch.dtype] = None) -> None:
        """Re-reads the sinks parameter (loaded after construction) on the host."""
        del act_dtype
        if self.sinks is not None:
            self._sinks_list = _floats(self.sinks)

    @property
    def warnings(self) -> List[str]:
        return list(self.native.warnings)

    def _read_native_scales(self) -> None:
        n = self.native
        self._q_scale_float, self._k_scale_float, self._v_scale_float = (
            n.q_scale, n.k_scale, n.v_scale)
        self._k_scales = list(n.k_scales) or None
        self._v_scales = list(n.v_scales) or None
        q_scales = list(n.q_scales)
        if q_scales and self.query_quant:
            if any(x != q_scales[0] for x in q_scales):
                raise _C.NotSupported(
                    "per-head q scales of differing values: this layer quantises the query "
                    "with one q_scale")
            self._q_scale_float = q_scales[0]

    def _cache(self) -> Tuple[torch.Tensor, torch.Tensor]:
        owner = self
        if self.kv_sharing_target_layer_name is not None:
            owner = self._context.layers.get(self.kv_sharing_target_layer_name)
            if owner is None:
                raise _C.InvalidArgument(
                    f"layer {self.layer_name}: KV sharing target "
                    f"{self.kv_sharing_target_layer_name} is no longer registered")
        cache = owner.kv_cache[self._context.virtual_engine]
        if cache is None:
            raise _C.InvalidArgument(f"layer {owner.layer_name} has no KV cache bound")
        if isinstance(cache, (tuple, list)):
            return cache[0], cache[1]
        return cache[:, 0], cache[:, 1]

    # forward ----------------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        output_shape: Optional[torch.Size] = None,
        *,
        attn_metadata: Optional[AttentionMetadata] = None,
    ) -> torch.Tensor:
        """query ``[T, num_heads * head_size]``, key/value ``[T, num_kv_heads * head_size]`` or
        None (cross-attention decode steps). Returns ``[T, num_heads * head_size]`` (rows past
        num_actual_tokens are zero). ``attn_metadata`` overrides the forward context's."""
        md = attn_metadata if attn_metadata is not None else self._context.metadata_for(
            self.layer_name)
        shape = output_shape if output_shape is not None else query.shape
        output = torch.zeros(shape, dtype=query.dtype, device=query.device)
        if md is None:  # profiling run: no writes, zero output
            return output
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query.view(-1, hq, d)
        k = key.view(-1, hk, d) if key is not None else None
        v = value.view(-1, hk, d) if value is not None else None
        out = output.view(-1, hq, d)
        if self.calculate_kv_scales and k is not None:
            s = pagedattn.calc_kv_scales(q.detach(), k.detach(), v.detach())
            if not s.all_zero:
                self._q_scale_float, self._k_scale_float, self._v_scale_float = (
                    s.q_scale, s.k_scale, s.v_scale)
                self.calculate_kv_scales = False
        cached = self.attn_type in ("decoder", "encoder_decoder")
        key_cache = value_cache = None
        if cached:
            key_cache, value_cache = self._cache()
            if k is not None and self.kv_sharing_target_layer_name is None:
                torch.ops.pagedattn.write_kv(k, v, key_cache, value_cache, md.slot_mapping,
                                             self.kv_cache_dtype, self._k_scale_float,
                                             self._v_scale_float, self._k_scales,
                                             self._v_scales)
        lse = torch.empty((hq, q.shape[0]), dtype=torch.float32, device=q.device)
        torch.ops.pagedattn.attention(
            q, None if cached else k, None if cached else v, key_cache, value_cache,
            md.query_start_loc, md.seq_lens, md.block_table if cached else None, out, lse,
            md.max_query_len, md.max_seq_len, md.num_actual_tokens, self.attn_type, self.scale,
            self.sliding_window or 0, self.logits_soft_cap or 0.0, self.alibi_slopes,
            self._sinks_list, self.kv_cache_dtype, self._k_scale_float, self._v_scale_float,
            md.query_start_loc_cpu, md.seq_lens_cpu, self._backend_name, self.query_quant,
            self._q_scale_float, self._k_scales, self._v_scales)
        return output.view(-1, shape[-1])


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: Any = None,
    layout: str = "NHD",
) -> torch.Tensor:
    """A zero-filled ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` cache tensor;
    ``layout='HND'`` stores each block as ``[2][num_kv_heads][block_size][head_size]`` and
    returns the same logical shape through strides. ``dtype`` may be a float8 dtype (or
    torch.uint8 for vLLM's byte caches). ``kv[:, 0]`` / ``kv[:, 1]`` are the K and V caches."""
    if layout == "NHD":
        return torch.zeros((num_blocks, 2, block_size, num_kv_heads, head_size), dtype=dtype,
                           device=device)
    if layout == "HND":
        storage = torch.zeros((num_blocks, 2, num_kv_heads, block_size, head_size), dtype=dtype,
                              device=device)
        return storage.permute(0, 1, 3, 2, 4)
    raise _C.InvalidArgument(f"layout '{layout}' is not 'NHD' or 'HND'")
