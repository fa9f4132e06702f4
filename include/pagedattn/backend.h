// The backend interface: what every attention implementation (ref, cpu, cuda) provides.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

class MLADeviceOps;  // pagedattn/mla_device_ops.h

/// What a backend is asked to support: the layer's configuration on a device.
struct BackendQuery {
  AttentionConfig config;
  Device device{};
};

/// A backend's per-step schedule (built on the host once per step, shared by the layers of a
/// KV-cache group). Opaque to callers; each backend derives its own.
class Plan {
 public:
  virtual ~Plan() = default;
  /// Scratch bytes run() needs for this step (the caller provides them as a Workspace).
  virtual size_t workspace_bytes() const { return 0; }
};

/// Caller-owned scratch memory on the compute device.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

/// Scatter of new K/V rows into the cache (vLLM's reshape_and_cache_flash).
struct WriteKVArgs {
  TensorView key;           ///< [num_kv_tokens, num_kv_heads, head_size], rows >= num_slots
  TensorView value;         ///< [num_kv_tokens, num_kv_heads, head_size]
  TensorView slot_mapping;  ///< int64 [num_slots]; token t goes to slot_mapping[t], -1 skips
  KVCacheView kv_cache;     ///< destination, any layout
  KVScales scales;          ///< fp8 only: stored = saturate(x / scale)
  Stream stream;
};

/// One attention call. The core validates every field against the config before a backend
/// sees it; backends trust shapes, dtypes and (in checked mode) metadata.
struct ForwardArgs {
  TensorView query;      ///< [num_tokens, num_heads, head_size], config.dtype
  TensorView key;        ///< encoder types only: [num_tokens, num_kv_heads, head_size]
  TensorView value;      ///< encoder types only: [num_tokens, num_kv_heads, head_size]
  KVCacheView kv_cache;  ///< decoder / encoder_decoder: read every key from here
  KVScales scales;
  const AttentionMetadata* metadata = nullptr;
  /// [num_tokens, num_heads, out_cols]; rows [0, T_a) are written. out_cols = head_size, or
  /// fewer: the output then holds the first out_cols columns of each row of P V (MLAAttention's
  /// latent output, the kv_lora_rank columns of the 576-wide entry that the layer up-projects).
  TensorView output;
  TensorView lse;  ///< optional float32 [num_heads, num_tokens]: natural-log LSE
  const Plan* plan = nullptr;
  Workspace workspace;
  Stream stream;
};

/// Merge of two partial attention results over disjoint key sets (spec 4.12).
struct MergeArgs {
  TensorView prefix_output;  ///< [num_tokens, num_heads, head_size]
  TensorView prefix_lse;     ///< float32 [num_heads, num_tokens]
  TensorView suffix_output;  ///< [num_tokens, num_heads, head_size]
  TensorView suffix_lse;     ///< float32 [num_heads, num_tokens]
  TensorView output;         ///< [num_tokens, num_heads, head_size]
  TensorView output_lse;     ///< optional float32 [num_heads, num_tokens]
  Stream stream;
};

/// Merge of `num_ranks` partial results over disjoint key sets, in rank order (decode context
/// parallelism, after the all-gather: include/pagedattn/exchange.h). Row (t, h) of `output` is
/// merge_states(... merge_states(rank 0, rank 1) ..., rank num_ranks - 1) computed in float32
/// and rounded once to the output dtype; a rank whose LSE is -inf (or +inf) is never read (its
/// rows may hold garbage), and a row no rank has keys for gets output 0 and LSE -inf.
struct MergeRanksArgs {
  TensorView partial_outputs;  ///< [num_ranks, num_tokens, num_heads, head_size], f32/f16/bf16
  TensorView partial_lses;     ///< float32 [num_ranks, num_heads, num_tokens]
  TensorView output;           ///< [num_tokens, num_heads, head_size], f32/f16/bf16
  TensorView output_lse;       ///< optional float32 [num_heads, num_tokens]
  Stream stream;
};

/// One layer's attention implementation, built by Backend::make_impl for a fixed config. An
/// implementation may keep device state between launches (the CUDA backend's prefill work-tile
/// counter), so one implementation's calls must run in stream order: on one stream, or on
/// streams ordered by events; use one implementation per concurrent stream.
class AttentionImpl {
 public:
  virtual ~AttentionImpl() = default;
  /// Scatters new K/V into the cache. Tokens with slot -1 are skipped.
  virtual void write_kv(const WriteKVArgs& args) = 0;
  /// Attention only: reads K/V from the cache (or args.key/value for encoder types).
  virtual void forward(const ForwardArgs& args) = 0;
};

/// One run-time option of a backend: a kernel variant or a tuning knob (`pagedattn backends`
/// lists them; Registry::configure sets them).
struct BackendOptionInfo {
  std::string name;                  ///< e.g. "prefill"
  std::string value;                 ///< the current value, spelled as configure accepts it
  std::vector<std::string> allowed;  ///< accepted values: words, or "an integer in [a, b]"
  std::string help;                  ///< one line: what it selects and what auto does
};

/// A family of kernels behind one name. Stateless apart from what it caches per device.
class Backend {
 public:
  virtual ~Backend() = default;
  /// Registry name ("ref", "cpu", "cuda").
  virtual std::string_view name() const = 0;
  /// One line for `pagedattn backends`.
  virtual std::string_view description() const = 0;
  /// Why this backend cannot serve `query` (empty = supported). Each reason is a sentence a
  /// user can act on, e.g. "head_size 80 not in {64, 128, 256}".
  virtual std::vector<std::string> check(const BackendQuery& query) const = 0;
  /// Builds the per-layer implementation. Precondition: check() returned no reasons.
  virtual std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig& config,
                                                   Device device) const = 0;
  /// Builds a step's schedule for layers shaped like `config`. Default: an empty plan.
  virtual std::unique_ptr<Plan> plan(const AttentionMetadata& metadata,
                                     const AttentionConfig& config) const;
  /// Optional: merges two partial results. Default throws NotSupported.
  virtual void merge_states(const MergeArgs& args) const;
  /// Optional: merges N ranks' partial results in rank order. Default: host tensors (float32
  /// math, as MergeRanksArgs says); throws NotSupported for tensors on another device.
  virtual void merge_ranks(const MergeRanksArgs& args) const;
  /// Optional: max |x| over a floating tensor on `device` (for scale calibration).
  /// Default: host tensors only.
  virtual float amax(const TensorView& x) const;
  /// Optional: the backend's options with their current values. Default: none.
  virtual std::vector<BackendOptionInfo> options() const;
  /// Optional: a new backend of the same kind whose options are this one's with `settings`
  /// ("name=value" each, applied in order) on top. An unknown name or a value outside what the
  /// option allows throws InvalidArgument naming the option, the value and what is allowed.
  /// Default: throws InvalidArgument (no options).
  virtual std::unique_ptr<Backend> configured(const std::vector<std::string>& settings) const;
  /// Optional: the kernels MLAAttention runs around this backend's attention on its devices
  /// (pagedattn/mla_device_ops.h), owned by the backend. Default: none (nullptr), and an
  /// MLAAttention layer on this backend then takes host tensors only.
  virtual const MLADeviceOps* mla_device_ops() const { return nullptr; }
  /// Optional: one line on which of its kernel families serves `device` and why (for example
  /// the cuda backend's Hopper or portable kernels by compute capability), for `pagedattn
  /// backends`. Default: empty (one family everywhere).
  virtual std::string device_info(Device device) const;
};

}  // namespace pagedattn

namespace pagedattn {

/// Checks a forward call against its layer config before any backend runs it: shapes, dtypes,
/// devices, the cache geometry and (for host-visible metadata) the metadata itself. Throws
/// InvalidArgument naming the argument and the bound.
/// `check_metadata` = false skips validate_metadata (done once per step and cache by the layer).
void check_forward_args(const AttentionConfig& config, const ForwardArgs& args,
                        bool check_metadata = true);
/// Checks a write_kv call against its layer config (shapes, dtypes and, when `check_slots` and
/// the slots are host-visible, every slot inside the cache or -1).
void check_write_kv_args(const AttentionConfig& config, const WriteKVArgs& args,
                         bool check_slots = true);
/// Checks a merge call (matching shapes, float32 LSEs).
void check_merge_args(const MergeArgs& args);
/// Checks a merge_ranks call: shapes that agree, float32 LSEs, f32/f16/bf16 outputs contiguous
/// in head_size, every tensor on the output's device. Builds no string unless it throws.
void check_merge_ranks_args(const MergeRanksArgs& args);

}  // namespace pagedattn
