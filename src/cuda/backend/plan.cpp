#include "cuda/backend/plan.h"

#include <algorithm>

#include "cuda/attn_common/config.h"
#include "cuda/decode/config.h"
#include "pagedattn/dtype.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

int choose_num_splits(const SplitInputs& in) {
  if (in.num_sms <= 0 || in.ctas_per_sm <= 0) return 1;
  // Work in units of 1 / (dc * pc) of an SM, so both kernels' CTAs count in integers: a decode
  // CTA (dc per SM) is pc units, a prefill CTA (pc per SM) dc units. The Hopper prefill kernel
  // holds a whole SM: weighing its CTAs as decode CTAs over-split chunked prefill (h8/1 q256
  // over 8k-32k: 15 splits ran at 0.74-0.85x of 8; q1024: 4 splits at 0.91-0.97x of 2).
  const int64_t dc = in.ctas_per_sm;
  const int64_t pc = in.prefill_ctas_per_sm > 0 ? in.prefill_ctas_per_sm : in.ctas_per_sm;
  const int64_t slots = int64_t(in.num_sms) * dc * pc;
  int64_t work = 0;
  int max_kv = 0;
  for (size_t r = 0; r < in.q_lens.size(); ++r) {
    if (in.q_lens[r] <= 0) continue;
    const int64_t rows = int64_t(in.q_lens[r]) * in.group;
    const bool prefill = in.route_rows >= 0 && rows > in.route_rows;
    const int64_t per_cta = prefill ? in.prefill_block_m : decode::kRows;
    work += int64_t(in.num_kv_heads) * ((rows + per_cta - 1) / per_cta) * (prefill ? dc : pc);
    max_kv = std::max(max_kv, in.kv_lens[r]);
  }
  if (work == 0) return 1;
  const int s_max = std::clamp(max_kv / attn::kMinSplitTokens, 1, attn::kMaxSplits);
  if (s_max == 1) return 1;
  auto efficiency = [&](int s) {
    const int64_t load = work * s;
    const int64_t waves = (load + slots - 1) / slots;
    return double(load) / double(waves * slots);
  };
  double best = 0;
  for (int s = 1; s <= s_max; ++s) best = std::max(best, efficiency(s));
  for (int s = 1; s <= s_max; ++s) {
    if (efficiency(s) >= 0.9 * best) return s;
  }
  return 1;
}

namespace {
size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}
}  // namespace

size_t split_lse_offset(int num_splits, int num_actual_tokens, int num_heads, int head_size) {
  return align256(size_t(num_splits) * size_t(num_actual_tokens) * size_t(num_heads) *
                  size_t(head_size) * sizeof(float));
}

size_t split_workspace_bytes(int num_splits, int num_actual_tokens, int num_heads, int head_size) {
  if (num_splits <= 1) return 0;
  return split_lse_offset(num_splits, num_actual_tokens, num_heads, head_size) +
         align256(size_t(num_splits) * size_t(num_actual_tokens) * size_t(num_heads) *
                  sizeof(float));
}

void reserve_query_quant(CudaPlan& plan, const AttentionConfig& config) {
  if (!config.query_quant) return;
  plan.q_offset = align256(plan.workspace);
  plan.q_bytes = size_t(plan.num_actual_tokens) * size_t(config.num_heads) *
                 size_t(config.head_size) * dtype_size(config.dtype);
  plan.workspace = plan.q_offset + plan.q_bytes;
}

void refuse_rows_without_keys(const AttentionMetadata& md, const AttentionConfig& config) {
  if (config.attn_type != AttentionType::kDecoder) return;
  const TensorView& qsl = md.query_start_loc_cpu;
  const TensorView& sl = md.seq_lens_cpu;
  if (md.num_seqs <= 0 || !qsl.defined() || !sl.defined()) return;
  detail::require(qsl.device.is_cpu() && sl.device.is_cpu(),
                  "cuda backend: metadata.query_start_loc_cpu and seq_lens_cpu must be host views");
  auto at = [](const TensorView& v, int i) {
    return static_cast<const int32_t*>(v.data)[int64_t(i) * v.stride(0)];
  };
  for (int r = 0; r < md.num_seqs; ++r) {
    const int q = at(qsl, r + 1) - at(qsl, r), s = at(sl, r);
    if (s < q) {
      detail::fail<NotSupported>(
          "cuda backend: request ", r, " has ", q, " query tokens but seq_len ", s,
          " keys, so its first ", q - s,
          " rows see no key under the causal mask; the cuda kernels are not verified to write "
          "output 0 and LSE -inf for such rows, so they refuse them (the cpu and ref backends "
          "serve them)");
    }
  }
}

std::unique_ptr<CudaPlan> make_plan(const AttentionMetadata& md, const AttentionConfig& config,
                                    int num_sms, int ctas_per_sm, int route_rows,
                                    int prefill_block_m, int prefill_ctas_per_sm) {
  auto plan = std::make_unique<CudaPlan>();
  plan->num_actual_tokens = md.num_actual_tokens;
  plan->num_heads = config.num_heads;
  plan->head_size = config.head_size;
  const TensorView& qsl = md.query_start_loc_cpu;
  const TensorView& sl = md.seq_lens_cpu;
  if (md.num_seqs <= 0 || md.num_actual_tokens <= 0 || !qsl.defined() || !sl.defined()) {
    reserve_query_quant(*plan, config);
    return plan;
  }
  detail::require(qsl.device.is_cpu() && sl.device.is_cpu(),
                  "plan: metadata.query_start_loc_cpu and seq_lens_cpu must be host views");
  SplitInputs in;
  in.num_sms = num_sms;
  in.ctas_per_sm = ctas_per_sm;
  in.num_kv_heads = config.num_kv_heads;
  in.group = config.num_queries_per_kv();
  in.route_rows = route_rows;
  in.prefill_block_m = prefill_block_m;
  in.prefill_ctas_per_sm = prefill_ctas_per_sm;
  const bool cached = uses_kv_cache(config.attn_type);
  auto at = [](const TensorView& v, int i) {
    return static_cast<const int32_t*>(v.data)[int64_t(i) * v.stride(0)];
  };
  refuse_rows_without_keys(md, config);
  for (int r = 0; r < md.num_seqs; ++r) {
    const int q = at(qsl, r + 1) - at(qsl, r);
    int kv = cached ? at(sl, r) : q;
    // A window caps what any of the request's rows sees at window_left + q keys.
    if (const int left = config.window_left(); left >= 0) kv = std::min(kv, left + q);
    in.q_lens.push_back(q);
    in.kv_lens.push_back(kv);
  }
  plan->num_splits = choose_num_splits(in);
  plan->workspace = split_workspace_bytes(plan->num_splits, md.num_actual_tokens, config.num_heads,
                                          config.head_size);
  reserve_query_quant(*plan, config);
  return plan;
}

}  // namespace pagedattn::cuda
