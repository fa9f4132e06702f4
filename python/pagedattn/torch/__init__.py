"""pagedattn for PyTorch: ops registered with torch.library, an ``Attention`` module and
drop-in replacements for vLLM's FlashAttention functions; ``pagedattn.torch.fa2`` and
``pagedattn.torch.fa3`` carry FlashAttention 2's and 3's own signatures.

Importing this module registers ``torch.ops.pagedattn.write_kv``,
``torch.ops.pagedattn.attention`` and ``torch.ops.pagedattn.merge_attn_states`` (each with a
fake implementation, so ``torch.library.opcheck`` passes, ``torch.compile(fullgraph=True)``
traces through them and their kernels can be captured in ``torch.cuda.CUDAGraph``). Every op
runs on torch's current CUDA stream. See docs/python.md.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (only to fail early with a clear message)
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("pagedattn.torch needs PyTorch (pip install torch)") from e

from pagedattn.torch import _ops  # noqa: F401  (registers the ops)
from pagedattn.torch.flash_attn import (
    flash_attn_varlen_func,
    merge_attn_states,
    reshape_and_cache_flash,
)
from pagedattn.torch.kvcache import flash_attn_with_kvcache
from pagedattn.torch import fa2, fa3  # noqa: E402  (FlashAttention 2 / 3 signatures)
from pagedattn.torch.layer import (
    Attention,
    AttentionMetadata,
    ForwardContext,
    allocate_kv_cache,
    get_forward_context,
    set_forward_context,
)

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ForwardContext",
    "allocate_kv_cache",
    "flash_attn_varlen_func",
    "fa2",
    "fa3",
    "flash_attn_with_kvcache",
    "get_forward_context",
    "merge_attn_states",
    "reshape_and_cache_flash",
    "set_forward_context",
]
