#include "pagedattn/metadata.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

namespace {
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

template <class T>
TensorView host_view(const std::vector<T>& v, DType dtype, std::vector<int64_t> shape) {
  return TensorView::contiguous(const_cast<T*>(v.data()), dtype, shape);
}
}  // namespace

AttentionMetadata StepMetadata::view() const {
  AttentionMetadata m;
  m.num_seqs = int(seq_lens.size());
  m.num_actual_tokens = query_start_loc.empty() ? 0 : query_start_loc.back();
  m.max_query_len = max_query_len;
  m.max_seq_len = max_seq_len;
  m.causal = causal;
  m.query_start_loc = host_view(query_start_loc, DType::kI32, {m.num_seqs + 1});
  m.seq_lens = host_view(seq_lens, DType::kI32, {m.num_seqs});
  m.block_table = host_view(block_table, DType::kI32, {m.num_seqs, max_blocks_per_seq});
  m.slot_mapping = host_view(slot_mapping, DType::kI64, {int64_t(slot_mapping.size())});
  m.query_start_loc_cpu = m.query_start_loc;
  m.seq_lens_cpu = m.seq_lens;
  return m;
}

AttentionMetadata StepMetadata::to_device(Device device) {
  AttentionMetadata m = view();
  if (device.is_cpu()) return m;
  device_query_start_loc_ = Tensor::copy_of(m.query_start_loc, device);
  device_seq_lens_ = Tensor::copy_of(m.seq_lens, device);
  device_block_table_ = Tensor::copy_of(m.block_table, device);
  device_slot_mapping_ = Tensor::copy_of(m.slot_mapping, device);
  m.query_start_loc = device_query_start_loc_.view();
  m.seq_lens = device_seq_lens_.view();
  m.block_table = device_block_table_.view();
  m.slot_mapping = device_slot_mapping_.view();
  return m;
}

MetadataBuilder::MetadataBuilder(int block_size) : block_size_(block_size) {
  require(block_size > 0, "block_size (", block_size, ") must be > 0");
}

MetadataBuilder& MetadataBuilder::add(const RequestSpec& request) {
  const size_t r = requests_.size();
  require(request.context_len >= 0, "request ", r, ": context_len (", request.context_len,
          ") must be >= 0");
  require(request.num_new_tokens >= 0, "request ", r, ": num_new_tokens (", request.num_new_tokens,
          ") must be >= 0");
  const int64_t seq_len = int64_t(request.context_len) + request.num_new_tokens;
  // No block ids at all: a request of a cacheless (encoder) layer; its slots are -1.
  require(request.block_ids.empty() ||
              int64_t(request.block_ids.size()) >= ceil_div(seq_len, block_size_),
          "request ", r, ": ", request.block_ids.size(), " block ids cannot hold seq_len ", seq_len,
          " at block_size ", block_size_, " (needs ", ceil_div(seq_len, block_size_), ")");
  requests_.push_back(request);
  return *this;
}

MetadataBuilder& MetadataBuilder::add_padding_requests(int count) {
  require(count >= 0, "add_padding_requests: count (", count, ") must be >= 0");
  for (int i = 0; i < count; ++i) requests_.push_back(RequestSpec{});
  return *this;
}

MetadataBuilder& MetadataBuilder::pad_slots_to(int num_tokens) {
  pad_slots_to_ = num_tokens;
  return *this;
}

MetadataBuilder& MetadataBuilder::causal(bool causal) {
  causal_ = causal;
  return *this;
}

MetadataBuilder& MetadataBuilder::max_seq_len_at_least(int max_seq_len) {
  min_max_seq_len_ = max_seq_len;
  return *this;
}

StepMetadata MetadataBuilder::build() const {
  StepMetadata s;
  s.causal = causal_;
  size_t width = 1;  // vLLM keeps at least one column, even for encoder-only batches
  for (const auto& r : requests_) width = std::max(width, r.block_ids.size());
  s.max_blocks_per_seq = int(width);
  s.query_start_loc.push_back(0);
  for (const auto& r : requests_) {
    const int seq_len = r.context_len + r.num_new_tokens;
    s.query_start_loc.push_back(s.query_start_loc.back() + r.num_new_tokens);
    s.seq_lens.push_back(seq_len);
    s.max_query_len = std::max(s.max_query_len, r.num_new_tokens);
    s.max_seq_len = std::max(s.max_seq_len, seq_len);
    for (size_t j = 0; j < width; ++j) {
      s.block_table.push_back(j < r.block_ids.size() ? r.block_ids[j] : 0);
    }
    for (int i = 0; i < r.num_new_tokens; ++i) {
      const int pos = r.context_len + i;
      s.slot_mapping.push_back(r.block_ids.empty()
                                   ? -1
                                   : int64_t(r.block_ids[size_t(pos / block_size_)]) * block_size_ +
                                         pos % block_size_);
    }
  }
  s.max_seq_len = std::max(s.max_seq_len, min_max_seq_len_);
  while (int(s.slot_mapping.size()) < pad_slots_to_) s.slot_mapping.push_back(-1);
  return s;
}

namespace {

void require_vector(const TensorView& v, std::string_view name, DType dtype, int64_t min_len,
                    bool exact) {
  require(v.defined(), "metadata.", name, " is missing");
  require(v.ndim == 1, "metadata.", name, " must be 1-D; got ", describe(v));
  require(v.dtype == dtype, "metadata.", name, " must be ", dtype_name(dtype), "; got ",
          describe(v));
  if (exact) {
    require(v.size(0) == min_len, "metadata.", name, " has ", v.size(0), " entries; expected ",
            min_len);
  } else {
    require(v.size(0) >= min_len, "metadata.", name, " has ", v.size(0),
            " entries; expected at least ", min_len);
  }
  // Plans and kernels index these vectors as plain arrays.
  require(v.size(0) <= 1 || v.stride(0) == 1, "metadata.", name,
          " must be contiguous; its stride is ", v.stride(0));
}

int64_t at_i32(const TensorView& v, int64_t i) {
  return static_cast<const int32_t*>(v.data)[i * v.stride(0)];
}

}  // namespace

void validate_metadata(const AttentionMetadata& m, AttentionType attn_type,
                       const CacheGeometry& cache) {
  require(m.num_seqs >= 0, "metadata.num_seqs (", m.num_seqs, ") must be >= 0");
  require(m.num_actual_tokens >= 0, "metadata.num_actual_tokens (", m.num_actual_tokens,
          ") must be >= 0");
  // Every backend's plan reads the host mirrors (StepMetadata::view() and the Python package
  // set them; on the CPU they may be the same views as query_start_loc and seq_lens).
  const TensorView& qsl = m.query_start_loc_cpu;
  const TensorView& sl = m.seq_lens_cpu;
  const int64_t num_seqs = m.num_seqs;
  // The arrays the kernels read, where given, have the mirrors' shapes (values: checked mode).
  // Checked first, so that a mirror that is the same view is reported under the caller's name.
  if (m.query_start_loc.defined()) {
    require_vector(m.query_start_loc, "query_start_loc", DType::kI32, num_seqs + 1, true);
  }
  if (m.seq_lens.defined()) require_vector(m.seq_lens, "seq_lens", DType::kI32, num_seqs, true);
  require_vector(qsl, "query_start_loc_cpu", DType::kI32, num_seqs + 1, true);
  require_vector(sl, "seq_lens_cpu", DType::kI32, num_seqs, true);
  require(qsl.device.is_cpu() && sl.device.is_cpu(),
          "metadata.query_start_loc_cpu and seq_lens_cpu must be host views");
  require(at_i32(qsl, 0) == 0, "metadata.query_start_loc[0] (", at_i32(qsl, 0), ") must be 0");
  int64_t max_q = 0, max_s = 0;
  for (int r = 0; r < m.num_seqs; ++r) {
    const int64_t begin = at_i32(qsl, r), end = at_i32(qsl, r + 1);
    require(end >= begin, "metadata.query_start_loc must be non-decreasing: [", r + 1, "] = ", end,
            " < [", r, "] = ", begin);
    const int64_t q = end - begin, s = at_i32(sl, r);
    require(s >= 0, "metadata.seq_lens[", r, "] (", s, ") must be >= 0");
    // A query longer than its keys (s < q) is legal for the cached types, as FlashAttention's
    // varlen call takes seqlen_q > seqlen_k: its positions s - q + i start below 0, and under
    // the decoder's bottom-right causal mask a row at a negative position sees no key (output
    // 0, LSE -inf). Cross attention reads the encoder's s keys however many tokens ask.
    if (!uses_kv_cache(attn_type)) {
      require(s == q, "metadata.seq_lens[", r, "] (", s, ") must equal the query length (", q,
              ") for ", to_string(attn_type), " attention, which has no cache");
    }
    max_q = std::max(max_q, q);
    max_s = std::max(max_s, s);
  }
  const int64_t total = at_i32(qsl, m.num_seqs);
  require(total == m.num_actual_tokens, "metadata.num_actual_tokens (", m.num_actual_tokens,
          ") != query_start_loc[num_seqs] (", total, ")");
  require(m.max_query_len >= max_q, "metadata.max_query_len (", m.max_query_len,
          ") is below the longest query (", max_q, ")");
  require(m.max_seq_len >= max_s, "metadata.max_seq_len (", m.max_seq_len,
          ") is below the longest sequence (", max_s, ")");
  if (attn_type == AttentionType::kDecoder) {
    require(m.causal, "metadata.causal must be true for decoder attention");
  } else {
    require(!m.causal, "metadata.causal must be false for ", to_string(attn_type), " attention");
  }
  if (!uses_kv_cache(attn_type)) return;

  require(cache.block_size > 0, "cache block_size (", cache.block_size, ") must be > 0");
  const TensorView& bt = m.block_table;
  require(bt.defined() && bt.ndim == 2 && bt.dtype == DType::kI32,
          "metadata.block_table must be int32 [num_seqs, max_blocks_per_seq]; got ", describe(bt));
  require(bt.size(0) >= m.num_seqs, "metadata.block_table has ", bt.size(0),
          " rows; expected num_seqs (", m.num_seqs, ")");
  const TensorView& slots = m.slot_mapping;
  require(slots.defined() && slots.ndim == 1 && slots.dtype == DType::kI64,
          "metadata.slot_mapping must be int64 [num_slots]; got ", describe(slots));
  const bool decoder = attn_type == AttentionType::kDecoder;
  if (decoder) {
    require(slots.size(0) >= m.num_actual_tokens, "metadata.slot_mapping has ", slots.size(0),
            " entries; a decoder step writes num_actual_tokens (", m.num_actual_tokens, ")");
  }
  // Widths are checked from the host seq_lens; values need host-visible tables.
  for (int r = 0; r < m.num_seqs; ++r) {
    const int64_t need = ceil_div(at_i32(sl, r), cache.block_size);
    require(need <= bt.size(1), "metadata.block_table has ", bt.size(1), " columns; request ", r,
            " with seq_len ", at_i32(sl, r), " needs ", need, " blocks of ", cache.block_size);
  }
  if (!bt.device.is_cpu() || !slots.device.is_cpu()) return;

  auto block_at = [&](int r, int64_t j) {
    return int64_t(static_cast<const int32_t*>(bt.data)[r * bt.stride(0) + j * bt.stride(1)]);
  };
  std::unordered_set<int64_t> all_used;  // for cross attention, whose slots name no request
  for (int r = 0; r < m.num_seqs; ++r) {
    const int64_t used = ceil_div(at_i32(sl, r), cache.block_size);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t b = block_at(r, j);
      require(b >= 0 && b < cache.num_blocks, "metadata.block_table[", r, "][", j, "] (", b,
              ") is outside the cache's blocks [0, ", cache.num_blocks, ")");
      if (!decoder) all_used.insert(b);
    }
  }
  const int64_t num_slots = slots.size(0);
  const int64_t capacity = cache.num_blocks * cache.block_size;
  auto slot_at = [&](int64_t t) {
    return static_cast<const int64_t*>(slots.data)[t * slots.stride(0)];
  };
  int r = 0;
  // Two tokens written to one slot race on a GPU (which one lands is undefined).
  std::unordered_map<int64_t, int64_t> writer;
  for (int64_t t = 0; t < num_slots; ++t) {
    const int64_t slot = slot_at(t);
    if (slot == -1) continue;
    require(slot >= 0 && slot < capacity, "metadata.slot_mapping[", t, "] (", slot,
            ") is outside the cache's slots [0, ", capacity, ") and not -1");
    const auto [it, first] = writer.emplace(slot, t);
    require(first, "metadata.slot_mapping[", t, "] (", slot, ") repeats slot_mapping[", it->second,
            "]: two tokens would write one slot");
    const int64_t block = slot / cache.block_size;
    if (!decoder) {
      require(all_used.count(block) > 0, "metadata.slot_mapping[", t, "] (", slot,
              ") lies in block ", block, ", which no request's used blocks contain");
      continue;
    }
    require(t < m.num_actual_tokens, "metadata.slot_mapping[", t, "] (", slot,
            ") is past num_actual_tokens (", m.num_actual_tokens, ") and must be -1");
    while (at_i32(qsl, r + 1) <= t) ++r;  // token t belongs to request r
    const int64_t used = ceil_div(at_i32(sl, r), cache.block_size);
    bool own = false;
    for (int64_t j = 0; j < used && !own; ++j) own = block_at(r, j) == block;
    require(own, "metadata.slot_mapping[", t, "] (", slot, ") lies in block ", block,
            ", which is not one of request ", r, "'s ", used, " blocks");
  }
}

}  // namespace pagedattn
