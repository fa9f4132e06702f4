// Reading and writing the safetensors container format: an 8-byte little-endian header length,
// a JSON header naming every tensor's dtype, shape and byte range, then the raw little-endian
// data. docs/case_format.md lists what the reader accepts and what the writer produces.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/tensor.h"

namespace pagedattn {

/// Largest JSON header the reader accepts (the bound the reference implementation uses).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// The safetensors name of a dtype: "F64" "F32" "F16" "BF16" "F8_E4M3" "F8_E5M2" "I64" "I32"
/// "U8".
std::string_view safetensors_dtype_name(DType dtype);
/// The DType of a safetensors dtype name; nullopt for names this library cannot hold (I16,
/// BOOL, F8_E8M0, ...).
std::optional<DType> dtype_from_safetensors_name(std::string_view name);

/// The contents of one safetensors file: named host tensors plus the `__metadata__` string map.
/// Both maps are ordered by name, so writing the same object twice gives the same bytes.
struct SafeTensors {
  std::map<std::string, Tensor, std::less<>> tensors;        ///< host tensors by name
  std::map<std::string, std::string, std::less<>> metadata;  ///< `__metadata__`

  /// True when a tensor called `name` exists.
  bool contains(std::string_view name) const { return tensors.find(name) != tensors.end(); }
  /// The tensor called `name`, or nullptr.
  const Tensor* find(std::string_view name) const;
  /// The metadata value called `key`, or nullptr.
  const std::string* find_metadata(std::string_view key) const;
};

/// Parses a whole safetensors file held in memory. Throws FormatError, naming the tensor or
/// field and the bound it broke, for: fewer than 8 bytes; a header length past the file or
/// above kMaxSafetensorsHeaderBytes; a header that is not a JSON object, or has duplicate keys;
/// a tensor entry without a string `dtype`, an integer-array `shape` or a two-integer
/// `data_offsets`; a dtype outside safetensors_dtype_name's list; negative dimensions or more
/// than kMaxDims of them; a byte range whose size is not shape x dtype size, that ends past the
/// data buffer or begins after its end; overlapping tensors; bytes of the data buffer that no
/// tensor covers (holes or a tail, as the format forbids); a `__metadata__` that is not an
/// object of scalars. A rank-0 (scalar) tensor is read as shape [1].
SafeTensors parse_safetensors(std::span<const uint8_t> bytes);
/// Reads and parses `path`. Throws Error when the file cannot be read, FormatError as above
/// (the message starts with the path).
SafeTensors load_safetensors(const std::string& path);

/// The bytes of `file`: tensors in name order, the header padded with spaces to a multiple of
/// 8 bytes. Tensors may have any strides and live on any device (they are copied to the host).
std::vector<uint8_t> serialize_safetensors(const SafeTensors& file);
/// Writes `file` to `path` atomically: a temporary file in the same directory, then a rename.
void save_safetensors(const std::string& path, const SafeTensors& file);

}  // namespace pagedattn
