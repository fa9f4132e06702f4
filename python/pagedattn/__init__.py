"""pagedattn: vLLM's attention layer (paged KV cache, metadata, backends) for Python.

Arrays cross into the library by DLPack without a copy: numpy arrays on the CPU, torch
tensors on the CPU or a CUDA device, or any other DLPack producer. Arrays the library allocates
come back as numpy arrays on the CPU (fp8 as uint8 bytes); bfloat16 and CUDA arrays come back
as DLPack-capable arrays that ``torch.from_dlpack`` accepts.

``pagedattn.torch`` (imported separately, needs torch) registers the ops with
``torch.library`` and offers an ``nn.Module`` and drop-in ``flash_attn_varlen_func`` /
``reshape_and_cache_flash`` functions. docs/python.md is the guide.

Errors: every library error derives from :class:`Error` (a ``RuntimeError``);
:class:`InvalidArgument` and :class:`FormatError` are also ``ValueError``s and
:class:`NotSupported` a ``NotImplementedError``. Messages are the C++ library's.
"""

from __future__ import annotations

from pagedattn import _C
from pagedattn._C import (
    Attention,
    AttentionConfig,
    AttentionMetadata,
    Backend,
    BackendOptionInfo,
    BackendVerdict,
    CacheConfig,
    CalibratedScales,
    Case,
    CaseCheck,
    CaseResult,
    Error,
    ErrorStats,
    FormatError,
    ForwardContext,
    Impl,
    InvalidArgument,
    KVCacheSpec,
    MetadataBuilder,
    MLAAttention,
    MultiHeadAttention,
    NotSupported,
    Plan,
    RequestSpec,
    StepMetadata,
    TensorCheck,
    Tolerance,
    alibi_slopes,
    allocate_kv_cache,
    amax,
    array_info,
    calc_kv_scales,
    cast,
    check_case,
    compare,
    default_tolerance,
    device_count,
    explain,
    format_verdicts,
    get_backend,
    kv_cache_storage_dtype,
    list_backends,
    load_case,
    make_random_case,
    run_case,
    save_case,
    save_case_result,
    select_backend,
    to_float32,
    validate_metadata,
)
from pagedattn._functional import (
    configure_backend,
    current_stream,
    get_impl,
    merge_attn_states,
    step,
    write_kv,
)

__version__: str = _C.__version__
#: True when the extension was compiled with the CUDA backend.
with_cuda: bool = _C.with_cuda
#: True when the SIMD CPU backend is compiled in (else only the float64 reference runs on CPU).
with_cpu_backend: bool = _C.with_cpu_backend

__all__ = [
    "Attention",
    "AttentionConfig",
    "AttentionMetadata",
    "Backend",
    "BackendOptionInfo",
    "BackendVerdict",
    "CacheConfig",
    "CalibratedScales",
    "Case",
    "CaseCheck",
    "CaseResult",
    "Error",
    "ErrorStats",
    "FormatError",
    "ForwardContext",
    "Impl",
    "InvalidArgument",
    "KVCacheSpec",
    "MetadataBuilder",
    "MLAAttention",
    "MultiHeadAttention",
    "NotSupported",
    "Plan",
    "RequestSpec",
    "StepMetadata",
    "TensorCheck",
    "Tolerance",
    "alibi_slopes",
    "allocate_kv_cache",
    "amax",
    "array_info",
    "calc_kv_scales",
    "cast",
    "check_case",
    "compare",
    "configure_backend",
    "current_stream",
    "default_tolerance",
    "device_count",
    "explain",
    "format_verdicts",
    "get_backend",
    "get_impl",
    "kv_cache_storage_dtype",
    "list_backends",
    "load_case",
    "make_random_case",
    "merge_attn_states",
    "run_case",
    "save_case",
    "save_case_result",
    "select_backend",
    "step",
    "to_float32",
    "validate_metadata",
    "with_cpu_backend",
    "with_cuda",
    "write_kv",
    "__version__",
]
