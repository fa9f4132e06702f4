// Test helper: runs one small attention step through a backend's impl (write, then attend) on
// float32 host tensors and returns the output and LSE as plain vectors.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"

namespace pagedattn::testing {

inline constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

/// Values are [tokens][heads][head_size] flattened.
struct StepInputs {
  std::vector<float> query;        // [num_tokens, num_heads, head_size]
  std::vector<float> key, value;   // [num_tokens, num_kv_heads, head_size]
  std::vector<float> context_key;  // decoder context: [context_tokens, num_kv_heads, head_size]
  std::vector<float> context_value;
};

struct StepOutputs {
  std::vector<float> output;  // [num_tokens, num_heads, head_size], poisoned where unwritten
  std::vector<float> lse;     // [num_heads, num_tokens]
};

/// One request `r` of the step: its context tokens (positions 0..context_len-1) are written to
/// the cache first through the same write path, at the slots its block ids imply.
inline std::vector<int64_t> context_slots(const RequestSpec& r, int block_size) {
  std::vector<int64_t> slots;
  for (int pos = 0; pos < r.context_len; ++pos) {
    slots.push_back(int64_t(r.block_ids[size_t(pos / block_size)]) * block_size + pos % block_size);
  }
  return slots;
}

/// Runs `requests` (one step) with `config` (dtype float32, kv dtype as configured) on `backend`.
/// The context K/V of all requests are concatenated in request order in inputs.context_*.
inline StepOutputs run_step(const Backend& backend, const AttentionConfig& config,
                            const std::vector<RequestSpec>& requests, const StepInputs& in,
                            int num_blocks, KVScales scales = {}) {
  const int hq = config.num_heads, hk = config.num_kv_heads, d = config.head_size;
  MetadataBuilder builder(config.block_size);
  for (const auto& r : requests) builder.add(r);
  builder.causal(config.attn_type == AttentionType::kDecoder);
  StepMetadata step = builder.build();
  AttentionMetadata md = step.view();
  const int64_t t = md.num_actual_tokens;

  auto impl = backend.make_impl(config, Device::cpu());
  KVCache cache;
  ForwardArgs f;
  auto as_view = [](const std::vector<float>& v, int64_t rows, int heads, int hs) {
    return TensorView::contiguous(const_cast<float*>(v.data()), DType::kF32, {rows, heads, hs});
  };
  if (uses_kv_cache(config.attn_type)) {
    cache = KVCache::allocate(config, num_blocks);
    std::vector<int64_t> ctx_slots;
    for (const auto& r : requests) {
      const auto s = context_slots(r, config.block_size);
      ctx_slots.insert(ctx_slots.end(), s.begin(), s.end());
    }
    if (!ctx_slots.empty()) {
      WriteKVArgs w;
      w.key = as_view(in.context_key, int64_t(ctx_slots.size()), hk, d);
      w.value = as_view(in.context_value, int64_t(ctx_slots.size()), hk, d);
      w.slot_mapping =
          TensorView::contiguous(ctx_slots.data(), DType::kI64, {int64_t(ctx_slots.size())});
      w.kv_cache = cache.view();
      w.scales = scales;
      check_write_kv_args(config, w);
      impl->write_kv(w);
    }
    if (!in.key.empty()) {
      WriteKVArgs w;
      w.key = as_view(in.key, t, hk, d);
      w.value = as_view(in.value, t, hk, d);
      w.slot_mapping = md.slot_mapping;
      w.kv_cache = cache.view();
      w.scales = scales;
      check_write_kv_args(config, w);
      impl->write_kv(w);
    }
    f.kv_cache = cache.view();
  } else {
    f.key = as_view(in.key, t, hk, d);
    f.value = as_view(in.value, t, hk, d);
  }
  StepOutputs out;
  out.output.assign(size_t(t * hq * d), kPoison);
  out.lse.assign(size_t(hq * t), kPoison);
  f.query = as_view(in.query, t, hq, d);
  f.output = TensorView::contiguous(out.output.data(), DType::kF32, {t, hq, d});
  f.lse = TensorView::contiguous(out.lse.data(), DType::kF32, {hq, t});
  f.scales = scales;
  f.metadata = &md;
  auto plan = backend.plan(md, config);
  f.plan = plan.get();
  check_forward_args(config, f);
  impl->forward(f);
  return out;
}

}  // namespace pagedattn::testing
