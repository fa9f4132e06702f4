#include "connector/kv_entry.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "pagedattn/error.h"
#include "pagedattn/safetensors.h"

namespace pagedattn::connector {

using detail::cat;
using json = nlohmann::json;

namespace {

std::string join_tokens(std::span<const int32_t> tokens) {
  std::string s;
  for (size_t i = 0; i < tokens.size(); ++i) s += cat(i ? "," : "", tokens[i]);
  return s;
}

// Exact text of a float (hexadecimal significand), so that equal scales compare equal.
std::string exact_float(float v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%a", double(v));
  return buf;
}

std::string join_scales(std::span<const KVScales> scales, bool k) {
  std::string s;
  for (size_t i = 0; i < scales.size(); ++i) {
    // Per-head scales as "[s0;s1;...]": an entry stored under other head scales never loads.
    const std::vector<float>& heads = k ? scales[i].k_scales : scales[i].v_scales;
    if (heads.empty()) {
      s += cat(i ? "," : "", exact_float(k ? scales[i].k_scale : scales[i].v_scale));
      continue;
    }
    s += i ? ",[" : "[";
    for (size_t h = 0; h < heads.size(); ++h) s += cat(h ? ";" : "", exact_float(heads[h]));
    s += "]";
  }
  return s;
}

std::string crc_hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

// The metadata fields that do not depend on the data (everything but the checksums).
std::map<std::string, std::string, std::less<>> expected_metadata(
    const KVConnectorConfig& c, const std::string& ns, const EntryIdentity& id,
    std::span<const KVScales> scales) {
  std::map<std::string, std::string, std::less<>> m;
  m["format"] = std::string(kEntryFormat);
  m["format_version"] = std::to_string(kEntryFormatVersion);
  m["namespace"] = ns;
  m["model"] = c.model;
  m["block_hash"] = hex64(id.hash);
  m["parent_hash"] = hex64(id.parent_hash);
  m["token_ids"] = join_tokens(id.token_ids);
  m["block_size"] = std::to_string(c.block_size);
  m["num_kv_heads"] = std::to_string(c.num_kv_heads);
  m["head_size"] = std::to_string(c.head_size);
  m["num_layers"] = std::to_string(c.layers.size());
  m["kv_cache_dtype"] = std::string(to_string(c.kv_cache_dtype));
  m["dtype"] = std::string(safetensors_dtype_name(c.cache_dtype));
  m["layout"] = "NHD";
  if (is_fp8(c.kv_cache_dtype)) {
    m["k_scales"] = join_scales(scales, true);
    m["v_scales"] = join_scales(scales, false);
  }
  return m;
}

std::vector<uint32_t> parse_crcs(std::string_view text, size_t n, bool& ok) {
  std::vector<uint32_t> out;
  ok = false;
  size_t pos = 0;
  for (size_t i = 0; i < n; ++i) {
    if (pos + 8 > text.size()) return out;
    uint32_t v = 0;
    for (size_t k = 0; k < 8; ++k) {
      const char ch = text[pos + k];
      int digit = -1;
      if (ch >= '0' && ch <= '9') digit = ch - '0';
      if (ch >= 'a' && ch <= 'f') digit = ch - 'a' + 10;
      if (digit < 0) return out;
      v = (v << 4) | uint32_t(digit);
    }
    out.push_back(v);
    pos += 8;
    if (i + 1 < n) {
      if (pos >= text.size() || text[pos] != ',') return out;
      ++pos;
    }
  }
  ok = pos == text.size();
  return out;
}

}  // namespace

std::string hex64(uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

size_t entry_layer_bytes(const KVConnectorConfig& c) {
  return 2 * size_t(c.block_size) * size_t(c.num_kv_heads) * size_t(c.head_size) *
         dtype_size(c.cache_dtype);
}

std::vector<uint8_t> serialize_entry(const KVConnectorConfig& config, const std::string& ns,
                                     const EntryIdentity& id, std::span<const Tensor> layers,
                                     std::span<const uint32_t> crcs,
                                     std::span<const KVScales> scales) {
  detail::require(layers.size() == config.layers.size() && crcs.size() == layers.size() &&
                      scales.size() == layers.size(),
                  "serialize_entry: ", layers.size(), " layer tensors, ", crcs.size(),
                  " checksums and ", scales.size(), " scales for ", config.layers.size(),
                  " layers");
  SafeTensors file;
  file.metadata = expected_metadata(config, ns, id, scales);
  std::string all;
  for (size_t i = 0; i < layers.size(); ++i) {
    file.tensors.emplace(config.layers[i].name, layers[i]);
    all += cat(i ? "," : "", crc_hex(crcs[i]));
  }
  file.metadata["crc32c"] = all;  // one per layer, in model order (config.layers)
  return serialize_safetensors(file);
}

uint64_t entry_header_length(const uint8_t prefix[8]) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | prefix[i];
  return v;
}

EntryCheck check_entry_header(std::string_view header, uint64_t entry_size,
                              const KVConnectorConfig& config, const std::string& ns,
                              const EntryIdentity& id, std::span<const KVScales> scales) {
  EntryCheck r;
  auto reject = [&r](auto&&... parts) {
    r.ok = false;
    r.reason = cat(parts...);
    return r;
  };
  json h;
  try {
    h = json::parse(header.begin(), header.end());
  } catch (const json::exception&) {
    return reject("the header is not valid JSON");
  }
  if (!h.is_object()) return reject("the header is not a JSON object");
  const auto meta_it = h.find("__metadata__");
  if (meta_it == h.end() || !meta_it->is_object()) return reject("the header has no __metadata__");
  const json& meta = *meta_it;
  auto field = [&meta](const std::string& key) -> const std::string* {
    const auto it = meta.find(key);
    return it != meta.end() && it->is_string() ? it->get_ptr<const std::string*>() : nullptr;
  };

  // Format first: a later version is a clear reason, not a list of odd fields.
  const std::string* format = field("format");
  if (!format || *format != kEntryFormat) {
    return reject("format is '", format ? *format : "(none)", "', expected '", kEntryFormat, "'");
  }
  const std::string* version = field("format_version");
  if (!version || *version != std::to_string(kEntryFormatVersion)) {
    return reject("format_version is ", version ? *version : "(none)", ", this build reads ",
                  kEntryFormatVersion);
  }
  const auto expected = expected_metadata(config, ns, id, scales);
  for (const auto& [key, want] : expected) {
    const std::string* got = field(key);
    if (!got || *got != want) {
      std::string shown = got ? *got : "(none)";
      if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
      std::string wanted = want.size() > 80 ? want.substr(0, 77) + "..." : want;
      return reject("__metadata__ field ", key, " is '", shown, "', expected '", wanted, "'");
    }
  }
  const size_t n = config.layers.size();
  const std::string* crc_text = field("crc32c");
  bool crc_ok = false;
  if (crc_text) r.layout.layer_crc = parse_crcs(*crc_text, n, crc_ok);
  if (!crc_ok) return reject("__metadata__ field crc32c is not ", n, " comma-separated CRCs");

  // Tensors: exactly one per layer, exact dtype and shape, tiling the data to the entry's end.
  const uint64_t data_begin = 8 + uint64_t(header.size());
  if (entry_size < data_begin) return reject("the entry ends inside its header");
  const uint64_t data_bytes = entry_size - data_begin;
  r.layout.data_begin = data_begin;
  const uint64_t layer_bytes = entry_layer_bytes(config);
  const std::vector<int64_t> shape = {2, config.block_size, config.num_kv_heads, config.head_size};
  const std::string dtype(safetensors_dtype_name(config.cache_dtype));
  if (h.size() != n + 1) return reject("the header has ", h.size() - 1, " tensors, expected ", n);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  r.layout.layer_offset.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& name = config.layers[i].name;
    const auto t = h.find(name);
    if (t == h.end() || !t->is_object()) return reject("no tensor for layer '", name, "'");
    const auto dt = t->find("dtype");
    if (dt == t->end() || !dt->is_string() || dt->get<std::string>() != dtype) {
      return reject("tensor '", name, "' dtype is ", dt == t->end() ? "(none)" : dt->dump(),
                    ", expected ", dtype);
    }
    const auto sh = t->find("shape");
    if (sh == t->end() || !sh->is_array() || sh->size() != 4 ||
        !std::all_of(sh->begin(), sh->end(), [](const json& v) { return v.is_number_integer(); }) ||
        sh->get<std::vector<int64_t>>() != shape) {
      return reject("tensor '", name, "' shape is ", sh == t->end() ? "(none)" : sh->dump(),
                    ", expected [2, ", config.block_size, ", ", config.num_kv_heads, ", ",
                    config.head_size, "]");
    }
    const auto off = t->find("data_offsets");
    if (off == t->end() || !off->is_array() || off->size() != 2 ||
        !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
      return reject("tensor '", name, "' has no valid data_offsets");
    }
    const uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (e < b || e - b != layer_bytes) {
      return reject("tensor '", name, "' data_offsets [", b, ", ", e, "] hold ", e - b,
                    " bytes, expected ", layer_bytes);
    }
    ranges.emplace_back(b, e);
    r.layout.layer_offset[i] = data_begin + b;
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [b, e] : ranges) {
    if (b != covered) return reject("tensor data ranges overlap or leave a hole at byte ", covered);
    covered = e;
  }
  if (covered != data_bytes) {
    return reject("the entry holds ", data_bytes, " data bytes, its tensors ", covered,
                  covered > data_bytes ? " (truncated)" : " (trailing bytes)");
  }
  r.ok = true;
  return r;
}

}  // namespace pagedattn::connector
