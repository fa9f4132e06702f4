// Argument conversion between Python and the pagedattn C++ API: DLPack arrays <-> TensorView,
// device / dtype / enum strings, streams, exported arrays, and the exception mapping.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "pagedattn/pagedattn.h"

namespace pagedattn::py {

namespace nb = nanobind;

/// Any DLPack producer or buffer (numpy, torch, cupy, ...), read-only access: inputs.
using InArray = nb::ndarray<nb::ro>;
/// A writable array: outputs, caches that are written.
using OutArray = nb::ndarray<>;

/// A zero-copy view of `a` (its dtype, shape, strides and device). fp8 DLPack codes
/// (float8_e4m3fn, float8_e5m2) become kFp8E4M3 / kFp8E5M2; `name` prefixes error messages.
/// Throws InvalidArgument for dtypes and devices pagedattn has no type for.
TensorView to_view(const InArray& a, std::string_view name);
TensorView to_view(const OutArray& a, std::string_view name);
/// An absent optional array becomes an undefined view (ndim 0).
TensorView to_view(const std::optional<InArray>& a, std::string_view name);
TensorView to_view(const std::optional<OutArray>& a, std::string_view name);

/// A view of any array-like object; None gives an undefined view. Raises InvalidArgument naming
/// `name` for objects that are no array.
TensorView to_view(nb::handle obj, std::string_view name, bool writable = false);

/// [rows, heads*head_size] (contiguous last dim) or [rows, heads, head_size] -> 3-D view.
/// Undefined views pass through.
TensorView as_heads(const TensorView& v, std::string_view name, int heads, int head_size);

/// A paged cache from either a combined [num_blocks, 2, block_size, num_kv_heads, head_size]
/// array or a (key_cache, value_cache) pair of [num_blocks, block_size, num_kv_heads, head_size]
/// arrays (vLLM's FlashAttention layout, any strides). uint8 caches are seen as `fp8` when given.
KVCacheView to_cache_view(nb::handle cache, std::string_view name,
                          std::optional<DType> fp8_dtype = std::nullopt);

/// "cpu", "cuda", "cuda:N" (also a torch.device or anything whose str() is one of these).
Device parse_device(nb::handle device);
/// Canonical dtype names ("float32", "bfloat16", "float8_e4m3fn", ...), also numpy / torch dtype
/// objects through their str() ("torch.bfloat16", "float16").
DType parse_dtype(nb::handle dtype);
/// A cudaStream_t passed as an integer (0 = the legacy default stream).
inline Stream to_stream(uintptr_t stream) {
  return Stream{reinterpret_cast<void*>(stream)};
}

/// Exports an owning tensor (its storage stays alive as long as the array): a numpy array when
/// it is on the CPU and numpy has its dtype, otherwise a DLPack-capable nanobind ndarray
/// (bfloat16, CUDA memory). fp8 tensors are exported as their uint8 bytes.
nb::object export_tensor(const Tensor& tensor);
/// Exports a view of memory that `owner` keeps alive (same rules as export_tensor).
nb::object export_view(const TensorView& view, nb::handle owner);

/// Installs the exception classes on `m` and the translator from pagedattn::Error:
/// InvalidArgument -> pagedattn.InvalidArgument (a ValueError), FormatError ->
/// pagedattn.FormatError (a ValueError), NotSupported -> pagedattn.NotSupported (a
/// NotImplementedError), any other Error -> pagedattn.Error (a RuntimeError). All derive from
/// pagedattn.Error.
void register_exceptions(nb::module_& m);

}  // namespace pagedattn::py
