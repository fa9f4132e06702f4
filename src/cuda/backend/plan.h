// The CUDA backend's per-step schedule: how many KV splits a decode launch uses, and the
// scratch they need. Built on the host from the metadata's *_cpu mirrors and scalars only.
#pragma once

#include <cstddef>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn::cuda {

/// One step's decisions for one layer shape. A captured graph keeps using the plan it was
/// captured with: every split count is correct for any seq_lens (the kernel cuts each
/// request's keys into num_splits pieces itself), only the balance may be worse.
class CudaPlan final : public Plan {
 public:
  int num_splits = 1;         ///< grid.y of the attention kernel; > 1 adds the combine kernel
  int num_actual_tokens = 0;  ///< T_a the workspace is sized for
  int num_heads = 0, head_size = 0;
  size_t workspace = 0;  ///< partial outputs and LSEs (0 when num_splits == 1), then q8
  /// config.query_quant: byte offset and size of the quantised query [T_a, num_heads,
  /// head_size] (the activation dtype, contiguous) in the workspace; q_bytes 0 = none.
  size_t q_offset = 0, q_bytes = 0;
  size_t workspace_bytes() const override { return workspace; }
};

/// What the split heuristic looks at.
struct SplitInputs {
  int num_sms = 0;      ///< multiprocessors of the device
  int ctas_per_sm = 0;  ///< resident CTAs of the chosen kernel per SM (occupancy)
  int num_kv_heads = 0;
  int group = 1;             ///< query heads per KV head
  std::vector<int> q_lens;   ///< per request
  std::vector<int> kv_lens;  ///< keys a request's rows can see (window-limited)
  /// >= 0: requests with more packed rows than this run on the prefill kernel, whose CTAs hold
  /// prefill_block_m rows; -1: every request runs on the decode kernel (16 rows per CTA).
  int route_rows = -1;
  int prefill_block_m = 128;
  /// Resident CTAs of the prefill kernel per SM (the Hopper kernel: 1); 0: ctas_per_sm.
  int prefill_ctas_per_sm = 0;
};

/// The number of KV splits (flash-decoding). CTAs without splitting:
/// work = sum over requests of num_kv_heads * ceil(q_len * G / rows per CTA) (16 on the decode
/// kernel, prefill_block_m on the prefill kernel), each CTA weighted by the share of an SM it
/// holds (1 / ctas_per_sm on the decode kernel, 1 / prefill_ctas_per_sm on the prefill
/// kernel). Splits multiply it; the choice is the smallest s in [1, s_max] whose wave
/// efficiency
///   eff(s) = work*s / (num_sms * ceil(work*s / num_sms))
/// reaches 90% of the best over that range, where s_max keeps >= kMinSplitTokens keys per
/// split of the longest request and at most kMaxSplits. A batch that already fills the
/// machine (eff(1) high) stays unsplit; one long request on 8 KV heads gets ~16-33 splits.
int choose_num_splits(const SplitInputs& in);

/// Workspace bytes of `num_splits` partials: [S, T, H, D] float outputs and [S, T, H] float
/// LSEs, each 256-byte aligned.
size_t split_workspace_bytes(int num_splits, int num_actual_tokens, int num_heads, int head_size);
/// Byte offset of the partial LSEs inside that workspace.
size_t split_lse_offset(int num_splits, int num_actual_tokens, int num_heads, int head_size);

/// Appends the quantised query's buffer to the plan's workspace when config.query_quant (call
/// after the split partials are sized).
void reserve_query_quant(CudaPlan& plan, const AttentionConfig& config);

/// Builds the plan for `metadata` and `config` on a device with `num_sms` SMs holding
/// `ctas_per_sm` CTAs of the kernel that will run (0 = unknown: no splitting).
/// `route_rows`, `prefill_block_m` and `prefill_ctas_per_sm` as in SplitInputs.
/// Throws NotSupported when a decoder request has fewer keys than query tokens (seq_len <
/// query_len, FlashAttention's seqlen_q > seqlen_k, zero keys included): its first rows see no
/// key under the bottom-right causal mask, and the kernels are not verified to write output 0
/// and LSE -inf for such rows (ref and cpu serve them). Reads the host mirrors only.
void refuse_rows_without_keys(const AttentionMetadata& metadata, const AttentionConfig& config);
std::unique_ptr<CudaPlan> make_plan(const AttentionMetadata& metadata,
                                    const AttentionConfig& config, int num_sms, int ctas_per_sm,
                                    int route_rows = -1, int prefill_block_m = 128,
                                    int prefill_ctas_per_sm = 0);

}  // namespace pagedattn::cuda
