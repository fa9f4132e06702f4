// The safetensors reader and writer. The reader trusts nothing in the file: every length and
// offset is checked against the bytes actually present before anything is read, and shape
// products are computed with overflow checks.
#include "pagedattn/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "pagedattn/error.h"

namespace pagedattn {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swaps");

using detail::cat;
using json = nlohmann::json;

namespace {

constexpr const char* kMetadataKey = "__metadata__";

// The header's nesting never goes past root object -> tensor entry -> shape array.
constexpr int kMaxJsonDepth = 8;

struct DTypeName {
  DType dtype;
  std::string_view name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::kF64, "F64"},   {DType::kF32, "F32"},         {DType::kF16, "F16"},
    {DType::kBF16, "BF16"}, {DType::kFp8E4M3, "F8_E4M3"}, {DType::kFp8E5M2, "F8_E5M2"},
    {DType::kI64, "I64"},   {DType::kI32, "I32"},         {DType::kU8, "U8"},
};

template <class... Args>
[[noreturn]] void format_fail(const Args&... args) {
  detail::fail<FormatError>("safetensors: ", args...);
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Parses the header text, rejecting duplicate keys (the JSON library keeps the last one
// silently) and nesting deeper than any valid header has.
json parse_header(std::string_view text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto callback = [&keys](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) {
          format_fail("header nests deeper than ", kMaxJsonDepth, " levels");
        }
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!keys.empty() && !keys.back().insert(k).second) {
          format_fail("duplicate key '", k, "' in the header",
                      keys.size() == 1 ? "" : " (inside an entry)");
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    format_fail("header is not valid JSON: ", e.what());
  }
}

// A non-negative JSON integer that fits int64, or a FormatError naming `what`.
int64_t non_negative_int(const json& v, const std::string& what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > uint64_t(INT64_MAX)) format_fail(what, " (", u, ") exceeds ", INT64_MAX);
    return int64_t(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if (i < 0) format_fail(what, " (", i, ") is negative");
    return i;
  }
  format_fail(what, " must be a non-negative integer; got ", v.dump());
}

std::string metadata_value(const std::string& key, const json& v) {
  if (v.is_string()) return v.get<std::string>();
  // Not in the format (values are strings) but common in hand-written files.
  if (v.is_number() || v.is_boolean() || v.is_null()) return v.dump();
  format_fail("__metadata__['", key, "'] must be a string (or a number, bool or null); got ",
              v.type_name());
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& name, const json& v, uint64_t data_bytes) {
  const std::string where = cat("tensor '", name, "'");
  if (!v.is_object()) format_fail(where, " must be an object; got ", v.type_name());
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) format_fail(where, " has no '", field, "'");
  }
  Entry e{name, DType::kU8, {}, 0, 0};
  const json& dt = v.at("dtype");
  if (!dt.is_string()) format_fail(where, ": 'dtype' must be a string; got ", dt.dump());
  const auto dtype = dtype_from_safetensors_name(dt.get_ref<const std::string&>());
  if (!dtype) {
    format_fail(where, ": dtype '", dt.get_ref<const std::string&>(),
                "' is not supported (supported: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 U8)");
  }
  e.dtype = *dtype;

  const json& shape = v.at("shape");
  if (!shape.is_array()) format_fail(where, ": 'shape' must be an array; got ", shape.dump());
  if (shape.size() > size_t(kMaxDims)) {
    format_fail(where, ": shape has ", shape.size(), " dimensions; at most ", kMaxDims,
                " are supported");
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    e.shape.push_back(non_negative_int(shape[d], cat(where, ": shape[", d, "]")));
  }

  const json& off = v.at("data_offsets");
  if (!off.is_array() || off.size() != 2) {
    format_fail(where, ": 'data_offsets' must be [begin, end]; got ", off.dump());
  }
  e.begin = uint64_t(non_negative_int(off[0], cat(where, ": data_offsets[0]")));
  e.end = uint64_t(non_negative_int(off[1], cat(where, ": data_offsets[1]")));
  if (e.begin > e.end) {
    format_fail(where, ": data_offsets begin (", e.begin, ") is after end (", e.end, ")");
  }
  if (e.end > data_bytes) {
    format_fail(where, ": data_offsets end (", e.end, ") is past the data buffer (", data_bytes,
                " bytes)");
  }

  // Element count with overflow checks; any zero dimension makes it zero.
  uint64_t numel = 1;
  bool overflow = false;
  if (std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end()) {
    numel = 0;
  } else {
    for (int64_t s : e.shape)
      overflow = overflow || __builtin_mul_overflow(numel, uint64_t(s), &numel);
  }
  uint64_t nbytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, uint64_t(dtype_size(e.dtype)), &nbytes);
  if (overflow || nbytes != e.end - e.begin) {
    std::string dims;
    for (int64_t s : e.shape) dims += cat(dims.empty() ? "" : ", ", s);
    format_fail(where, ": shape [", dims, "] of ", safetensors_dtype_name(e.dtype), " needs ",
                overflow ? std::string("more than 2^64") : std::to_string(nbytes),
                " bytes but data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin);
  }
  if (e.shape.empty()) e.shape.push_back(1);  // a scalar is read as [1]
  return e;
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  detail::fail("safetensors_dtype_name: unknown dtype code ", int(dtype));
}

std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
  for (const auto& d : kDTypeNames)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

const Tensor* SafeTensors::find(std::string_view name) const {
  const auto it = tensors.find(name);
  return it == tensors.end() ? nullptr : &it->second;
}

const std::string* SafeTensors::find_metadata(std::string_view key) const {
  const auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

SafeTensors parse_safetensors(std::span<const uint8_t> bytes) {
  if (bytes.size() < 8) {
    format_fail("file has ", bytes.size(), " bytes; the 8-byte header length alone needs 8");
  }
  const uint64_t header_len = read_u64_le(bytes.data());
  if (header_len > kMaxSafetensorsHeaderBytes) {
    format_fail("header length ", header_len, " exceeds the limit of ", kMaxSafetensorsHeaderBytes,
                " bytes");
  }
  if (header_len > bytes.size() - 8) {
    format_fail("header length ", header_len, " runs past the end of the file (", bytes.size() - 8,
                " bytes after the length)");
  }
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), header_len);
  const json header = parse_header(text);
  if (!header.is_object()) format_fail("header must be a JSON object; got ", header.type_name());

  const uint64_t data_bytes = bytes.size() - 8 - header_len;
  const uint8_t* data = bytes.data() + 8 + header_len;
  SafeTensors out;
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      if (!value.is_object())
        format_fail("__metadata__ must be an object; got ", value.type_name());
      for (const auto& [key, v] : value.items()) out.metadata[key] = metadata_value(key, v);
      continue;
    }
    entries.push_back(parse_entry(name, value, data_bytes));
  }

  // The byte ranges, in file order, must tile the data buffer exactly.
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* e : order) {
    if (e->begin < covered) {
      format_fail("tensor '", e->name, "' (bytes [", e->begin, ", ", e->end, ")) overlaps tensor '",
                  previous->name, "' (bytes [", previous->begin, ", ", previous->end, "))");
    }
    if (e->begin > covered) {
      format_fail("bytes [", covered, ", ", e->begin, ") of the data buffer belong to no tensor ",
                  "(a hole before tensor '", e->name, "'); the format forbids holes");
    }
    covered = e->end;
    previous = e;
  }
  if (covered != data_bytes) {
    format_fail("the data buffer has ", data_bytes, " bytes but the tensors cover only ", covered,
                "; the format forbids trailing bytes");
  }

  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (e.end > e.begin) std::memcpy(t.data(), data + e.begin, size_t(e.end - e.begin));
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

SafeTensors load_safetensors(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    detail::fail<Error>("cannot open '", path, "': ", ec ? ec.message() : "no such file");
  }
  if (!std::filesystem::is_regular_file(status)) {
    detail::fail<Error>("cannot read '", path, "': not a regular file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::fail<Error>("cannot open '", path, "': ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0, std::ios::beg);
  if (size < 0) detail::fail<Error>("cannot read the size of '", path, "'");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    detail::fail<Error>("cannot read ", size, " bytes from '", path, "'");
  }
  try {
    return parse_safetensors(bytes);
  } catch (const FormatError& e) {
    throw FormatError(cat(path, ": ", e.what()));
  }
}

std::vector<uint8_t> serialize_safetensors(const SafeTensors& file) {
  json header = json::object();
  std::vector<Tensor> host;  // contiguous host copies, in name order
  uint64_t offset = 0;
  for (const auto& [name, tensor] : file.tensors) {
    detail::require(name != kMetadataKey, "safetensors: a tensor cannot be called ", kMetadataKey);
    detail::require(tensor.defined() && tensor.view().defined(), "safetensors: tensor '", name,
                    "' is undefined");
    const TensorView& v = tensor.view();
    Tensor h = v.device.is_cpu() && v.is_contiguous() ? tensor : Tensor::copy_of(v, Device::cpu());
    const uint64_t nbytes = h.view().nbytes();
    header[name] = {{"dtype", std::string(safetensors_dtype_name(v.dtype))},
                    {"shape", v.shape_vector()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    host.push_back(std::move(h));
  }
  if (!file.metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, val] : file.metadata) meta[k] = val;
    header[kMetadataKey] = std::move(meta);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    detail::fail("safetensors: a tensor name or metadata string is not valid UTF-8: ", e.what());
  }
  text.resize((text.size() + 7) / 8 * 8, ' ');  // data starts 8-byte aligned

  std::vector<uint8_t> out(8 + text.size() + offset);
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(uint64_t(text.size()) >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* data = out.data() + 8 + text.size();
  for (const Tensor& h : host) {
    const size_t nbytes = h.view().nbytes();
    if (nbytes) std::memcpy(data, h.data(), nbytes);
    data += nbytes;
  }
  return out;
}

void save_safetensors(const std::string& path, const SafeTensors& file) {
  const std::vector<uint8_t> bytes = serialize_safetensors(file);
  static std::atomic<int> counter{0};
  const std::string tmp = cat(path, ".tmp.", ::getpid(), ".", counter++);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) detail::fail<Error>("cannot create '", tmp, "': ", std::strerror(errno));
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size() &&
                       std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    detail::fail<Error>("cannot write ", bytes.size(), " bytes to '", tmp,
                        "': ", std::strerror(write_errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    std::remove(tmp.c_str());
    detail::fail<Error>("cannot rename '", tmp, "' to '", path, "': ", std::strerror(rename_errno));
  }
}

}  // namespace pagedattn
