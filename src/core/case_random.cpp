// Random attention cases for tests and the `make-case` command.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>
#include <random>

#include "pagedattn/case_file.h"
#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Fills a host tensor with normal(0, 1) values divided by `divisor`, rounded to its dtype (fp8
// saturates, as the cache write does).
void fill_normal(const Tensor& t, std::mt19937_64& rng, double divisor = 1.0) {
  std::normal_distribution<double> normal(0.0, 1.0);
  const TensorView& v = t.view();
  for (int64_t i = 0, n = v.numel(); i < n; ++i) {
    store_element(v.data, v.dtype, i, float(normal(rng)) / float(divisor));
  }
}

template <class T>
Tensor vector_tensor(const std::vector<T>& values, DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::empty(shape, dtype);
  std::copy(values.begin(), values.end(), t.data_as<T>());
  return t;
}

}  // namespace

Case make_random_case(const CaseSpec& spec) {
  const AttentionType type = spec.attn_type;
  const bool cached = uses_kv_cache(type);
  require(spec.pad_tokens >= 0, "pad_tokens (", spec.pad_tokens, ") must be >= 0");
  require(spec.spare_blocks >= 0, "spare_blocks (", spec.spare_blocks, ") must be >= 0");
  require(spec.block_size > 0, "block_size (", spec.block_size, ") must be > 0");
  require(spec.head_size > 0, "head_size (", spec.head_size, ") must be > 0");
  require(!(is_fp8(spec.kv_cache_dtype) && !cached), "kv_cache_dtype ",
          to_string(spec.kv_cache_dtype), ": ", to_string(type),
          " attention has no KV cache to quantize");
  for (size_t r = 0; r < spec.requests.size(); ++r) {
    const CaseRequest& q = spec.requests[r];
    require(q.context_len >= 0 && q.num_new_tokens >= 0, "request ", r, " (", q.context_len, ":",
            q.num_new_tokens, ") has a negative length");
    require(cached || q.context_len == 0, "request ", r, ": ", to_string(type),
            " attention has no cache, so context_len (", q.context_len, ") must be 0");
  }

  Case c;
  AttentionConfig& cfg = c.config;
  cfg.num_heads = spec.num_heads;
  cfg.num_kv_heads = spec.num_kv_heads;
  cfg.head_size = spec.head_size;
  cfg.scale = spec.scale.value_or(1.0f / std::sqrt(float(spec.head_size)));
  cfg.sliding_window = spec.sliding_window;
  cfg.logits_soft_cap = spec.logits_soft_cap;
  cfg.attn_type = type;
  cfg.dtype = spec.dtype;
  cfg.kv_cache_dtype = spec.kv_cache_dtype;
  cfg.block_size = spec.block_size;
  cfg.query_quant = spec.query_quant;
  c.scales = spec.scales;
  for (const auto& [v, name] : {std::pair{&c.scales.k_scales, "k_scales"},
                                {&c.scales.v_scales, "v_scales"},
                                {&c.scales.q_scales, "q_scales"}}) {
    detail::require(v->empty() || v->size() == size_t(spec.num_kv_heads), "scales.", name, " has ",
                    v->size(), " values; a case takes none or num_kv_heads (", spec.num_kv_heads,
                    ")");
  }
  std::mt19937_64 rng(spec.seed);
  if (spec.alibi) {
    std::uniform_real_distribution<float> slope(1.0f / 64, 0.25f);
    for (int h = 0; h < spec.num_heads; ++h) cfg.alibi_slopes.push_back(slope(rng));
  }
  if (spec.sinks) {
    std::normal_distribution<float> sink(0.0f, 1.5f);
    for (int h = 0; h < spec.num_heads; ++h) cfg.sinks.push_back(sink(rng));
  }
  cfg.validate();

  // Physical blocks 1..num_blocks-1 in random order (block 0 is vLLM's null block).
  const int bs = spec.block_size;
  int64_t needed = 0;
  for (const CaseRequest& q : spec.requests) {
    needed += ceil_div(int64_t(q.context_len) + q.num_new_tokens, bs);
  }
  const int64_t num_blocks = 1 + (cached ? needed : 0) + spec.spare_blocks;
  std::vector<int32_t> free_blocks(size_t(num_blocks - 1));
  std::iota(free_blocks.begin(), free_blocks.end(), 1);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);

  MetadataBuilder builder(bs);
  builder.causal(type == AttentionType::kDecoder);
  size_t next_block = 0;
  std::vector<std::vector<int32_t>> blocks_of;
  for (const CaseRequest& q : spec.requests) {
    const int64_t seq_len = int64_t(q.context_len) + q.num_new_tokens;
    std::vector<int32_t> ids;
    for (int64_t j = 0; j < ceil_div(seq_len, bs); ++j) {
      // Encoder types: placeholder ids; their block table and slots are replaced below.
      ids.push_back(cached ? free_blocks[next_block++] : 0);
    }
    builder.add(RequestSpec{q.context_len, q.num_new_tokens, ids});
    blocks_of.push_back(std::move(ids));
  }
  StepMetadata step = builder.build();
  const int64_t num_actual = step.query_start_loc.back();
  const int64_t num_tokens = num_actual + spec.pad_tokens;
  std::vector<int64_t> slots = step.slot_mapping;
  if (!cached) {
    slots.assign(size_t(num_tokens), -1);
    step.block_table.assign(step.block_table.size(), 0);
  } else if (type == AttentionType::kEncoderDecoder) {
    // The encoder step writes every request's seq_len encoder tokens; a decode step writes none.
    slots.clear();
    for (size_t r = 0; spec.cross_kv && r < spec.requests.size(); ++r) {
      const int64_t seq_len = step.seq_lens[r];
      for (int64_t t = 0; t < seq_len; ++t) {
        slots.push_back(int64_t(blocks_of[r][size_t(t / bs)]) * bs + t % bs);
      }
    }
  } else {
    slots.resize(size_t(num_tokens), -1);  // padded rows are not written
  }

  const int64_t num_seqs = int64_t(step.seq_lens.size());
  c.query_start_loc = vector_tensor(step.query_start_loc, DType::kI32, {num_seqs + 1});
  c.seq_lens = vector_tensor(step.seq_lens, DType::kI32, {num_seqs});
  c.block_table = vector_tensor(step.block_table, DType::kI32, {num_seqs, step.max_blocks_per_seq});
  c.slot_mapping = vector_tensor(slots, DType::kI64, {int64_t(slots.size())});

  c.query = Tensor::empty({num_tokens, spec.num_heads, spec.head_size}, spec.dtype);
  fill_normal(c.query, rng);
  const bool with_kv = type != AttentionType::kEncoderDecoder || spec.cross_kv;
  if (with_kv) {
    const int64_t kv_rows =
        type == AttentionType::kEncoderDecoder ? int64_t(slots.size()) : num_tokens;
    c.key = Tensor::empty({kv_rows, spec.num_kv_heads, spec.head_size}, spec.dtype);
    c.value = Tensor::empty({kv_rows, spec.num_kv_heads, spec.head_size}, spec.dtype);
    fill_normal(c.key, rng);
    fill_normal(c.value, rng);
  }
  if (cached) {
    // Every slot holds a random value: the context tokens' K/V and garbage elsewhere (including
    // the slots this step overwrites). fp8 stores x / scale, like the write path.
    c.kv_cache =
        Tensor::empty({num_blocks, 2, bs, spec.num_kv_heads, spec.head_size}, cfg.cache_dtype());
    const bool fp8 = is_fp8(cfg.kv_cache_dtype);
    for (int64_t b = 0; b < num_blocks; ++b) {
      for (int kv = 0; kv < 2; ++kv) {
        Tensor page = c.kv_cache;
        page.view() = c.kv_cache.view().select(0, b).select(0, kv);
        if (!fp8 || !c.scales.per_head()) {
          fill_normal(page, rng, fp8 ? (kv == 0 ? c.scales.k_scale : c.scales.v_scale) : 1.0);
          continue;
        }
        // Per-head scales: element (o, h, d) of the contiguous page is x / scale of head h.
        std::normal_distribution<double> normal(0.0, 1.0);
        const TensorView& pv = page.view();
        for (int64_t i = 0, n = pv.numel(); i < n; ++i) {
          const int h = int((i / spec.head_size) % spec.num_kv_heads);
          const float scale = kv == 0 ? c.scales.k_scale_of(0, h, spec.num_kv_heads)
                                      : c.scales.v_scale_of(0, h, spec.num_kv_heads);
          store_element(pv.data, pv.dtype, i, float(normal(rng)) / scale);
        }
      }
    }
  }
  return c;
}

std::vector<CaseRequest> parse_case_requests(std::string_view text) {
  std::vector<CaseRequest> out;
  if (text.empty()) return out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    const size_t colon = item.find(':');
    CaseRequest r;
    bool ok = colon != std::string_view::npos;
    if (ok) {
      const char* b = item.data();
      const auto [p1, e1] = std::from_chars(b, b + colon, r.context_len);
      const auto [p2, e2] = std::from_chars(b + colon + 1, b + item.size(), r.num_new_tokens);
      ok = e1 == std::errc() && p1 == b + colon && e2 == std::errc() && p2 == b + item.size() &&
           r.context_len >= 0 && r.num_new_tokens >= 0;
    }
    require(ok, "requests: entry ", out.size(), " ('", item,
            "') must be context_len:num_new_tokens with non-negative integers, e.g. 0:7");
    out.push_back(r);
    start = comma + 1;
  }
  return out;
}

}  // namespace pagedattn
