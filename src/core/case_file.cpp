// Case files: from safetensors to a Case and back (docs/case_format.md). Everything the file
// says is checked here, with messages that name the tensor or metadata field, so that
// run_case only ever sees a consistent step.
#include "pagedattn/case_file.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;

namespace {

template <class... Args>
[[noreturn]] void bad(const Args&... args) {
  detail::fail<FormatError>("case file: ", args...);
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// Absent, null, "None", "none", "null" and "" all mean "not set" for the optional fields.
bool is_unset(const std::string* raw) {
  if (!raw) return true;
  std::string s = trim(*raw);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s.empty() || s == "none" || s == "null";
}

double parse_number(std::string_view field, const std::string& raw) {
  std::string s = trim(raw);
  if (!s.empty() && s[0] == '+') s.erase(0, 1);
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) {
    bad("metadata ", field, " ('", raw, "') is not a number");
  }
  return v;
}

int parse_int(std::string_view field, const std::string& raw) {
  const double v = parse_number(field, raw);
  if (!std::isfinite(v) || v != std::floor(v) || v < std::numeric_limits<int>::min() ||
      v > std::numeric_limits<int>::max()) {
    bad("metadata ", field, " ('", raw, "') is not an integer in the int32 range");
  }
  return int(v);
}

const std::string& required_field(const SafeTensors& f, std::string_view field,
                                  std::string_view example) {
  const std::string* v = f.find_metadata(field);
  if (!v) bad("metadata field '", field, "' is missing (expected e.g. \"", example, "\")");
  return *v;
}

// "float32[4, 8, 64]" for messages.
std::string desc(const Tensor& t) {
  return describe(t.view());
}

// [rows, heads, head_size] or [rows, heads * head_size] -> [rows, heads, head_size].
Tensor as_heads(const Tensor& t, std::string_view name, int heads, int head_size,
                std::string_view heads_field) {
  const TensorView& v = t.view();
  if (v.ndim == 3 && v.size(1) == heads && v.size(2) == head_size) return t;
  if (v.ndim == 2 && v.size(1) == int64_t(heads) * head_size) {
    Tensor out = t;
    out.view() = v.reshape({v.size(0), heads, head_size});
    return out;
  }
  bad("tensor '", name, "' must be [num_tokens, ", heads_field, "=", heads,
      ", head_size=", head_size, "] or [num_tokens, ", heads_field,
      "*head_size=", int64_t(heads) * head_size, "]; got ", desc(t));
}

// An int32 copy of an I32 / I64 tensor of rank `ndim`, every value checked to fit.
Tensor int32_tensor(const Tensor& t, std::string_view name, int ndim, std::string_view dims) {
  const TensorView& v = t.view();
  if (v.ndim != ndim || (v.dtype != DType::kI32 && v.dtype != DType::kI64)) {
    bad("tensor '", name, "' must be int32 ", dims, "; got ", desc(t));
  }
  if (v.dtype == DType::kI32) return t;
  Tensor out = Tensor::empty(v.shape_vector(), DType::kI32);
  const auto* src = v.data_as<const int64_t>();
  for (int64_t i = 0, n = v.numel(); i < n; ++i) {
    if (src[i] < std::numeric_limits<int32_t>::min() ||
        src[i] > std::numeric_limits<int32_t>::max()) {
      bad("tensor '", name, "' element ", i, " (", src[i], ") does not fit int32");
    }
    out.data_as<int32_t>()[i] = int32_t(src[i]);
  }
  return out;
}

Tensor int64_vector(const Tensor& t, std::string_view name) {
  const TensorView& v = t.view();
  if (v.ndim != 1 || (v.dtype != DType::kI32 && v.dtype != DType::kI64)) {
    bad("tensor '", name, "' must be int64 [num_slots]; got ", desc(t));
  }
  if (v.dtype == DType::kI64) return t;
  Tensor out = Tensor::empty(v.shape_vector(), DType::kI64);
  for (int64_t i = 0; i < v.numel(); ++i) out.data_as<int64_t>()[i] = v.data_as<int32_t>()[i];
  return out;
}

std::vector<float> per_head_floats(const Tensor& t, std::string_view name, int num_heads,
                                   std::string_view heads = "num_heads") {
  const TensorView& v = t.view();
  if (v.ndim != 1 || v.size(0) != num_heads || !is_floating(v.dtype) || is_fp8(v.dtype)) {
    bad("tensor '", name, "' must be float32 [", heads, "=", num_heads, "]; got ", desc(t));
  }
  std::vector<float> out(static_cast<size_t>(num_heads));
  for (int h = 0; h < num_heads; ++h) out[size_t(h)] = float(load_element(v.data, v.dtype, h));
  return out;
}

// The metadata fields (docs/case_format.md, "Metadata").
void read_config(const SafeTensors& f, Case& c) {
  AttentionConfig& cfg = c.config;
  cfg.num_heads = parse_int("num_heads", required_field(f, "num_heads", "32"));
  cfg.num_kv_heads = parse_int("num_kv_heads", required_field(f, "num_kv_heads", "8"));
  cfg.head_size = parse_int("head_size", required_field(f, "head_size", "128"));
  cfg.scale = float(parse_number("scale", required_field(f, "scale", "0.08838834764")));
  try {
    const std::string* t = f.find_metadata("attn_type");
    cfg.attn_type = is_unset(t) ? AttentionType::kDecoder : parse_attn_type(trim(*t));
    const std::string* d = f.find_metadata("kv_cache_dtype");
    cfg.kv_cache_dtype = is_unset(d) ? KVCacheDType::kAuto : parse_kv_cache_dtype(trim(*d));
  } catch (const InvalidArgument& e) {
    bad("metadata ", e.what());
  }
  for (auto [field, scale] :
       {std::pair{"k_scale", &c.scales.k_scale}, {"v_scale", &c.scales.v_scale}}) {
    const std::string* raw = f.find_metadata(field);
    *scale = is_unset(raw) ? 1.0f : float(parse_number(field, *raw));
    if (is_fp8(cfg.kv_cache_dtype) && !(std::isfinite(*scale) && *scale > 0.0f)) {
      bad("metadata ", field, " (", *raw, ") must be finite and > 0 for an fp8 cache");
    }
  }
  if (const std::string* raw = f.find_metadata("sliding_window"); !is_unset(raw)) {
    const int w = parse_int("sliding_window", *raw);
    if (w != -1 && w < 1) {
      bad("metadata sliding_window (", *raw,
          ") must be >= 1 (it counts the current token), or -1 / absent for no window");
    }
    if (w != -1) cfg.sliding_window = w;
  }
  if (const std::string* raw = f.find_metadata("logits_soft_cap"); !is_unset(raw)) {
    const double cap = parse_number("logits_soft_cap", *raw);
    if (!(std::isfinite(cap) && cap >= 0.0)) {
      bad("metadata logits_soft_cap (", *raw, ") must be finite and > 0, or 0 / absent for none");
    }
    if (cap > 0.0) cfg.logits_soft_cap = float(cap);
  }
  if (const std::string* raw = f.find_metadata("query_quant"); !is_unset(raw)) {
    const int on = parse_int("query_quant", *raw);
    if (on != 0 && on != 1) bad("metadata query_quant (", *raw, ") must be 0 or 1");
    cfg.query_quant = on == 1;
  }
  if (cfg.query_quant) {
    const std::string* raw = f.find_metadata("q_scale");
    c.scales.q_scale = is_unset(raw) ? 1.0f : float(parse_number("q_scale", *raw));
    if (!(std::isfinite(c.scales.q_scale) && c.scales.q_scale > 0.0f)) {
      bad("metadata q_scale (", *raw, ") must be finite and > 0 for query_quant");
    }
  }
}

const Tensor& required_tensor(const SafeTensors& f, std::string_view name, std::string_view why) {
  const Tensor* t = f.find(name);
  if (!t) bad("tensor '", name, "' is missing", why);
  return *t;
}

int64_t slot_at(const Case& c, int64_t t) {
  return c.slot_mapping.data_as<const int64_t>()[t];
}

}  // namespace

int Case::num_actual_tokens() const {
  const TensorView& q = query_start_loc.view();
  return q.defined() && q.size(0) > 0 ? q.data_as<const int32_t>()[q.size(0) - 1] : 0;
}

AttentionMetadata Case::metadata() const {
  AttentionMetadata m;
  m.num_seqs = num_seqs();
  m.num_actual_tokens = num_actual_tokens();
  m.causal = config.attn_type == AttentionType::kDecoder;
  m.query_start_loc = m.query_start_loc_cpu = query_start_loc.view();
  m.seq_lens = m.seq_lens_cpu = seq_lens.view();
  m.block_table = block_table.view();
  m.slot_mapping = slot_mapping.view();
  const auto* qsl = query_start_loc.data_as<const int32_t>();
  const auto* sl = seq_lens.data_as<const int32_t>();
  int64_t max_q = 0, max_s = 0;  // int64: the values are not validated yet
  for (int r = 0; r < m.num_seqs; ++r) {
    max_q = std::max(max_q, int64_t(qsl[r + 1]) - qsl[r]);
    max_s = std::max<int64_t>(max_s, sl[r]);
  }
  m.max_query_len = int(std::min<int64_t>(max_q, std::numeric_limits<int>::max()));
  m.max_seq_len = int(max_s);
  return m;
}

std::string describe(const Case& c) {
  const AttentionConfig& g = c.config;
  const AttentionMetadata m = c.metadata();
  std::string s = cat(to_string(g.attn_type), ", ", dtype_name(g.dtype), ", heads ", g.num_heads,
                      "/", g.num_kv_heads, ", head_size ", g.head_size, ", scale ", g.scale);
  if (c.kv_cache.defined()) {
    s += cat(", kv_cache ", to_string(g.kv_cache_dtype), " ", desc(c.kv_cache));
    if (is_fp8(g.kv_cache_dtype)) {
      auto scales = [](const std::vector<float>& heads, float whole) {
        if (heads.empty()) return cat(whole);
        std::string list = "[";
        for (size_t h = 0; h < heads.size(); ++h) list += cat(h ? ", " : "", heads[h]);
        return list + "]";
      };
      s += cat(" (k_scale ", scales(c.scales.k_scales, c.scales.k_scale), ", v_scale ",
               scales(c.scales.v_scales, c.scales.v_scale), ")");
    }
  }
  if (g.sliding_window) s += cat(", sliding_window ", *g.sliding_window);
  if (g.logits_soft_cap) s += cat(", logits_soft_cap ", *g.logits_soft_cap);
  if (g.has_alibi()) s += ", alibi";
  if (g.has_sinks()) s += ", sinks";
  s += cat("; ", m.num_seqs, " requests, ", m.num_actual_tokens, " tokens");
  if (c.num_tokens() > m.num_actual_tokens) {
    s += cat(" + ", c.num_tokens() - m.num_actual_tokens, " padding rows");
  }
  s += cat(", max_query_len ", m.max_query_len, ", max_seq_len ", m.max_seq_len);
  if (c.writes_kv()) {
    int64_t written = 0;
    for (int64_t t = 0; t < m.num_slots(); ++t) written += slot_at(c, t) >= 0;
    s += cat(", writes ", written, " of ", m.num_slots(), " slots");
  }
  return s;
}

Case case_from_safetensors(const SafeTensors& f) {
  Case c;
  read_config(f, c);
  AttentionConfig& cfg = c.config;
  const AttentionType type = cfg.attn_type;
  const bool cached = uses_kv_cache(type);
  const std::string type_name(to_string(type));
  if (cfg.num_heads <= 0 || cfg.num_kv_heads <= 0 || cfg.head_size <= 0) {
    bad("metadata num_heads (", cfg.num_heads, "), num_kv_heads (", cfg.num_kv_heads,
        ") and head_size (", cfg.head_size, ") must be > 0");
  }

  // Activations.
  const Tensor& query = required_tensor(f, "query", "");
  if (!is_activation_dtype(query.view().dtype)) {
    bad("tensor 'query' must be F32, F16 or BF16; got ", desc(query));
  }
  cfg.dtype = query.view().dtype;
  c.query = as_heads(query, "query", cfg.num_heads, cfg.head_size, "num_heads");
  const Tensor* key = f.find("key");
  const Tensor* value = f.find("value");
  if ((key == nullptr) != (value == nullptr)) {
    bad("tensor '", key ? "value" : "key", "' is missing while '", key ? "key" : "value",
        "' is present; give both or (encoder_decoder only) neither");
  }
  if (!key && type != AttentionType::kEncoderDecoder) {
    bad("tensor 'key' is missing; ", type_name, " cases need key and value");
  }
  if (key) {
    for (auto [t, name] : {std::pair{key, "key"}, {value, "value"}}) {
      if (t->view().dtype != cfg.dtype) {
        bad("tensor '", name, "' is ", desc(*t), "; it must have the query's dtype ",
            dtype_name(cfg.dtype));
      }
    }
    c.key = as_heads(*key, "key", cfg.num_kv_heads, cfg.head_size, "num_kv_heads");
    c.value = as_heads(*value, "value", cfg.num_kv_heads, cfg.head_size, "num_kv_heads");
    if (c.key.view().size(0) != c.value.view().size(0)) {
      bad("tensors 'key' ", desc(c.key), " and 'value' ", desc(c.value),
          " must have the same number of rows");
    }
  }

  // The cache.
  if (const Tensor* kv = f.find("kv_cache")) {
    const TensorView& v = kv->view();
    if (!cached) {
      c.kv_cache = *kv;  // passed through unchanged
      if (v.ndim == 5 && v.size(2) > 0) cfg.block_size = int(v.size(2));
    } else {
      if (v.ndim != 5 || v.size(1) != 2 || v.size(3) != cfg.num_kv_heads ||
          v.size(4) != cfg.head_size) {
        bad("tensor 'kv_cache' must be [num_blocks, 2, block_size, num_kv_heads=", cfg.num_kv_heads,
            ", head_size=", cfg.head_size, "]; got ", desc(*kv));
      }
      if (v.size(2) < 1 || v.size(2) > std::numeric_limits<int>::max()) {
        bad("tensor 'kv_cache' ", desc(*kv), " needs block_size >= 1");
      }
      cfg.block_size = int(v.size(2));
      const DType want = kv_cache_storage_dtype(cfg.kv_cache_dtype, cfg.dtype);
      c.kv_cache = *kv;
      if (is_fp8(want) && v.dtype == DType::kU8) {  // vLLM allocates fp8 caches as bytes
        c.kv_cache.view().dtype = want;
        c.kv_cache_as_bytes = true;
      } else if (v.dtype != want) {
        bad("tensor 'kv_cache' is ", desc(*kv), " but kv_cache_dtype '",
            to_string(cfg.kv_cache_dtype), "' with query dtype ", dtype_name(cfg.dtype), " stores ",
            safetensors_dtype_name(want), " (", dtype_name(want), ")");
      }
    }
  } else if (cached) {
    bad("tensor 'kv_cache' is missing; ", type_name, " cases need the cache before the step");
  }
  if (is_fp8(cfg.kv_cache_dtype) && !cached) {
    bad("metadata kv_cache_dtype '", to_string(cfg.kv_cache_dtype),
        "': quantization is not supported for ", type_name, " attention (it has no KV cache)");
  }

  // The step's metadata tensors.
  c.query_start_loc = int32_tensor(required_tensor(f, "query_start_loc", ""), "query_start_loc", 1,
                                   "[num_seqs + 1]");
  const int64_t num_seqs = c.query_start_loc.view().size(0) - 1;
  if (num_seqs < 0) bad("tensor 'query_start_loc' must have num_seqs + 1 >= 1 entries; got 0");
  const int32_t* qsl = c.query_start_loc.data_as<const int32_t>();
  if (const Tensor* sl = f.find("seq_lens"); sl || cached) {
    c.seq_lens =
        int32_tensor(sl ? *sl : required_tensor(f, "seq_lens", ""), "seq_lens", 1, "[num_seqs]");
    if (c.seq_lens.view().size(0) != num_seqs) {
      bad("tensor 'seq_lens' ", desc(c.seq_lens), " must have num_seqs = ", num_seqs,
          " entries (query_start_loc has ", num_seqs + 1, ")");
    }
  } else {  // encoder types: every request attends to its own tokens
    c.seq_lens = Tensor::empty({num_seqs}, DType::kI32);
    for (int64_t r = 0; r < num_seqs; ++r) c.seq_lens.data_as<int32_t>()[r] = qsl[r + 1] - qsl[r];
  }
  if (const Tensor* bt = f.find("block_table"); bt || cached) {
    c.block_table = int32_tensor(bt ? *bt : required_tensor(f, "block_table", ""), "block_table", 2,
                                 "[num_seqs, max_blocks_per_seq]");
    if (c.block_table.view().size(0) < num_seqs) {
      bad("tensor 'block_table' ", desc(c.block_table), " has fewer rows than num_seqs (", num_seqs,
          ")");
    }
  } else {
    c.block_table = Tensor::zeros({num_seqs, 1}, DType::kI32);
  }
  if (const Tensor* sm = f.find("slot_mapping")) {
    c.slot_mapping = int64_vector(*sm, "slot_mapping");
  } else if (type == AttentionType::kDecoder || c.writes_kv()) {
    required_tensor(f, "slot_mapping", cat("; ", type_name, " cases write K/V through it"));
  } else {  // nothing is written: no slot is used
    const int64_t n = cached ? 0 : c.num_tokens();
    c.slot_mapping = Tensor::empty({n}, DType::kI64);
    for (int64_t t = 0; t < n; ++t) c.slot_mapping.data_as<int64_t>()[t] = -1;
  }

  // Per-head parameters.
  if (const Tensor* a = f.find("alibi_slopes")) {
    cfg.alibi_slopes = per_head_floats(*a, "alibi_slopes", cfg.num_heads);
  }
  if (const Tensor* s = f.find("sinks")) cfg.sinks = per_head_floats(*s, "sinks", cfg.num_heads);
  // Per-KV-head fp8 scales (absent = the k_scale / v_scale / q_scale floats).
  for (auto [name, dst, used] :
       {std::tuple{"k_scales", &c.scales.k_scales, is_fp8(cfg.kv_cache_dtype)},
        {"v_scales", &c.scales.v_scales, is_fp8(cfg.kv_cache_dtype)},
        {"q_scales", &c.scales.q_scales, cfg.query_quant}}) {
    const Tensor* t = f.find(name);
    if (!t) continue;
    *dst = per_head_floats(*t, name, cfg.num_kv_heads, "num_kv_heads");
    for (size_t h = 0; used && h < dst->size(); ++h) {
      if (!(std::isfinite((*dst)[h]) && (*dst)[h] > 0.0f)) {
        bad("tensor '", name, "' element ", h, " (", (*dst)[h], ") must be finite and > 0");
      }
    }
  }

  if (c.num_actual_tokens() > c.num_tokens()) {
    bad("query_start_loc[num_seqs] (", c.num_actual_tokens(), ") exceeds the query's ",
        c.num_tokens(), " rows");
  }
  try {
    cfg.validate();
    CacheGeometry geometry;
    if (cached) geometry = {c.kv_cache.view().size(0), cfg.block_size};
    validate_metadata(c.metadata(), type, geometry);
  } catch (const InvalidArgument& e) {
    bad(e.what());
  }
  if (!cached && c.key.view().size(0) < c.num_actual_tokens()) {
    bad("tensor 'key' has ", c.key.view().size(0), " rows; ", type_name,
        " attention needs num_actual_tokens (", c.num_actual_tokens(), ")");
  }
  if (c.writes_kv() && c.key.view().size(0) < c.slot_mapping.view().size(0)) {
    bad("tensor 'key' has ", c.key.view().size(0), " rows but slot_mapping writes ",
        c.slot_mapping.view().size(0));
  }
  return c;
}

SafeTensors case_to_safetensors(const Case& c) {
  const AttentionConfig& cfg = c.config;
  SafeTensors f;
  auto put = [&f](const char* name, const Tensor& t) {
    if (t.defined()) f.tensors[name] = t;
  };
  put("query", c.query);
  put("key", c.key);
  put("value", c.value);
  if (c.kv_cache.defined()) {
    Tensor kv = c.kv_cache;
    if (c.kv_cache_as_bytes) kv.view().dtype = DType::kU8;
    put("kv_cache", kv);
  }
  put("block_table", c.block_table);
  put("seq_lens", c.seq_lens);
  put("query_start_loc", c.query_start_loc);
  put("slot_mapping", c.slot_mapping);
  auto per_head = [&](const char* name, const std::vector<float>& v) {
    if (v.empty()) return;
    Tensor t = Tensor::empty({int64_t(v.size())}, DType::kF32);
    std::copy(v.begin(), v.end(), t.data_as<float>());
    put(name, t);
  };
  per_head("alibi_slopes", cfg.alibi_slopes);
  per_head("sinks", cfg.sinks);
  per_head("k_scales", c.scales.k_scales);
  per_head("v_scales", c.scales.v_scales);
  per_head("q_scales", c.scales.q_scales);

  // Floats with 9 significant digits read back to the same float.
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    return std::string(buf);
  };
  auto& m = f.metadata;
  m["num_heads"] = std::to_string(cfg.num_heads);
  m["num_kv_heads"] = std::to_string(cfg.num_kv_heads);
  m["head_size"] = std::to_string(cfg.head_size);
  m["scale"] = num(cfg.scale);
  m["attn_type"] = std::string(to_string(cfg.attn_type));
  m["kv_cache_dtype"] = std::string(to_string(cfg.kv_cache_dtype));
  m["k_scale"] = num(c.scales.k_scale);
  m["v_scale"] = num(c.scales.v_scale);
  if (cfg.sliding_window) m["sliding_window"] = std::to_string(*cfg.sliding_window);
  if (cfg.logits_soft_cap) m["logits_soft_cap"] = num(*cfg.logits_soft_cap);
  if (cfg.query_quant) {
    m["query_quant"] = "1";
    m["q_scale"] = num(c.scales.q_scale);
  }
  return f;
}

Case load_case(const std::string& path) {
  const SafeTensors f = load_safetensors(path);
  try {
    return case_from_safetensors(f);
  } catch (const FormatError& e) {
    throw FormatError(cat(path, ": ", e.what()));
  }
}

void save_case(const std::string& path, const Case& c) {
  save_safetensors(path, case_to_safetensors(c));
}

}  // namespace pagedattn
