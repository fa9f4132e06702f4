// The serving simulation behind `pagedattn run`: a preset's attention layers (Attention, or
// MLAAttention for an MLA preset; sim_layer.h), their paged KV caches planned for a memory
// budget, a seeded request stream driven through the scheduler, every layer run on every step
// with random inputs (Q/K/V, or q/kv_c_normed/k_pe), timing, and checks against the float64
// reference. With a KV connector (or a digest file) each token's Q/K/V rows are a function of
// the seed, the token's prefix and the layer, as in a real model: K/V saved by one instance
// are then exactly what another would compute (disaggregated prefill, docs/connector.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/connector.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/mla.h"
#include "sim/presets.h"
#include "sim/workload.h"

namespace pagedattn::sim {

/// Progress after each step, for a progress bar.
struct Progress {
  int64_t step = 0;  ///< steps run so far
  int finished = 0;  ///< requests finished
  int total = 0;     ///< requests in the workload
  int running = 0;
  int waiting = 0;
};

/// Everything `pagedattn run` can set.
struct SimOptions {
  std::string preset = "llama-3-8b";  ///< a name from model_presets()
  std::string backend;                ///< empty = the registry's choice for each layer
  Device device = Device::cpu();      ///< where caches, activations and metadata live
  DType dtype = DType::kBF16;         ///< activations (query, key, value, output)
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;  ///< fp8 calibrates k/v scales once
  KVCacheLayout kv_cache_layout = KVCacheLayout::kNHD;
  int block_size = 16;
  /// KV-cache budget in bytes. Unset ("auto"): half the blocks the whole workload would pin if
  /// every request ran at once, and at least one request of max_model_len, so that requests
  /// compete for blocks (cached blocks get evicted, and requests may be preempted).
  std::optional<int64_t> kv_cache_memory;
  std::optional<int64_t> max_model_len;  ///< unset: min(the preset's, 1024)
  int max_num_batched_tokens = 256;
  int max_num_seqs = 32;
  bool enable_prefix_caching = true;
  /// MLA presets: the formulation MLAAttention runs each request in (kSplit, vLLM's: decodes
  /// absorbed, prefills with K/V expanded per head) and the latent entries of cached context it
  /// expands at once. Other presets refuse a value other than the default.
  MLAFormulation mla_formulation = MLAFormulation::kSplit;
  int mla_context_chunk_tokens = MLAOptions{}.context_chunk_tokens;
  /// The request stream; its max_model_len and vocab_size are set from the model.
  WorkloadOptions workload;
  /// Check a step against the float64 reference every this many steps (0 = never). A due
  /// step too large for the reference (see verify_max_work) passes the check to the next one.
  int verify_every = 4;
  int verify_layers = 1;  ///< layers checked per KV-cache group in a verified step
  /// Largest reference work per verified step: sum over the checked layers of
  /// (query, visible key) pairs * num_heads * head_size.
  int64_t verify_max_work = 200'000'000;
  std::string failure_dir = ".";  ///< where failing steps are saved as case files
  /// Measure the device's read bandwidth at the end: a streaming read on the CPU, the bytes a
  /// device-to-device copy reads per second on a GPU.
  bool measure_bandwidth = true;
  /// KV connector spec (pagedattn/connector.h): "storage:/dir" or "redis://host:port";
  /// empty = none. Entries are namespaced by the preset and the seed (the sim's "weights").
  std::string kv_connector;
  /// What this instance does with the connector: kBoth loads and saves; kProducer is a prefill
  /// instance (every request stops after its first token; prompts are saved); kConsumer is a
  /// decode instance (loads what the store holds, saves nothing). kBoth without a connector.
  KVTransferRole role = KVTransferRole::kBoth;
  /// Writes a digest of every output row that produced a token (positions >= prompt length - 1)
  /// of every layer to this file; empty = none. Runs of one workload on a batch-invariant
  /// backend (ref) give identical files whatever their schedules, hits and transfers (MLA: in
  /// the absorbed formulation; the prefill formulation merges partial results rounded to the
  /// activation dtype, and where a step splits cached context from new tokens moves them).
  std::string digest_file;
  std::function<void(const Progress&)> on_progress;  ///< called after each step
  std::ostream* log = nullptr;  ///< verification failures are described here (if set)
};

/// One KV-cache group of the plan.
struct GroupReport {
  std::string kind;                   ///< "full_attention" or "sliding_window"
  std::optional<int> sliding_window;  ///< the group's window
  int num_layers = 0;
};

/// The worst check of a run (largest error relative to its budget).
struct WorstCheck {
  int64_t step = -1;
  std::string layer;
  double max_abs = 0;  ///< max |backend - float64 reference|
  double budget = 0;   ///< 2 * max |naive low precision - float64 reference| + atol
};

/// What a run did; report.h prints it.
struct SimReport {
  // Model and engine.
  std::string preset;
  std::string layer_kind = "Attention";  ///< "Attention" or "MLAAttention"
  /// What the backends see: for MLA, num_kv_heads 1 and head_size L + R (the latent entry).
  int num_layers = 0, num_heads = 0, num_kv_heads = 0, head_size = 0;
  std::optional<MLAShape> mla;  ///< MLA presets: the latent sizes
  std::string mla_formulation;  ///< MLA presets: "split", "absorbed" or "prefill"
  int mla_context_chunk_tokens = 0;
  /// The real model's layers and heads when the preset runs fewer (0 = the same), and why.
  int model_num_layers = 0, model_num_heads = 0;
  std::string scaled_down_reason;
  std::string dtype, kv_cache_dtype, kv_cache_storage_dtype, kv_cache_layout;
  std::vector<std::pair<std::string, int>> backends;  ///< backend name, layers using it
  int block_size = 0;
  int64_t max_model_len = 0;
  int max_num_batched_tokens = 0, max_num_seqs = 0;
  bool prefix_caching = true;
  std::vector<GroupReport> groups;
  int64_t num_blocks = 0;       ///< per tensor, the null block included
  int64_t kv_cache_bytes = 0;   ///< all tensors
  int64_t kv_cache_budget = 0;  ///< bytes asked for (or chosen by "auto")
  bool kv_cache_budget_auto = false;
  std::optional<float> k_scale, v_scale;  ///< calibrated fp8 scales of layer 0 (MLA: k only)

  // Workload.
  WorkloadOptions workload;
  int num_requests = 0;
  int64_t workload_prompt_tokens = 0, workload_output_tokens = 0;

  // Run.
  int finished_requests = 0;
  int64_t steps = 0;
  int64_t mixed_steps = 0;  ///< steps with both prefill and decode tokens
  int64_t prefill_tokens = 0, decode_tokens = 0;
  int64_t partial_prefill_chunks = 0;
  int64_t preemptions = 0;
  int64_t lookup_tokens = 0, prefix_hit_tokens = 0;
  int64_t peak_blocks_used = 0, usable_blocks = 0;
  int64_t window_blocks_released = 0, evictions = 0;
  double attention_seconds = 0;  ///< sum of the layer forward calls (MLA: projections included)
  double wall_seconds = 0;       ///< the whole run, verification included
  double kv_bytes_read = 0;      ///< K and V (MLA: latent) bytes each step reads once, all layers
  double attention_flops = 0;    ///< 4 * (query, visible key) pairs * num_heads * head_size
  std::string device;            ///< "cpu", "cuda:0"
  std::optional<double> machine_read_bandwidth;  ///< bytes per second, see bandwidth_method
  std::string bandwidth_method;                  ///< how machine_read_bandwidth was measured

  // KV connector.
  std::string kv_connector;         ///< the spec, password hidden; empty = none
  std::string role = "both";        ///< "both", "producer" (prefill) or "consumer" (decode)
  KVConnectorStats connector;       ///< scheduler- and worker-side counters together
  int64_t external_hit_tokens = 0;  ///< prompt tokens loaded instead of computed
  int64_t load_error_requests = 0;  ///< request steps undone because a load failed
  int64_t load_error_tokens = 0;    ///< tokens those steps gave back (computed again)
  std::string digest_file;
  int64_t digest_rows = 0;  ///< (request, position, layer) rows in the digest

  // Verification.
  int verify_every = 0;
  int64_t verified_steps = 0, layer_checks = 0, failed_checks = 0;
  int64_t deferred_checks = 0;  ///< due steps skipped as too large for the reference
  double verify_seconds = 0;
  WorstCheck worst;
  std::vector<std::string> failure_files;

  bool passed() const { return failed_checks == 0; }
};

/// Runs the simulation. Throws InvalidArgument for bad options (an unknown preset, a budget too
/// small for one request of max_model_len, ...), NotSupported when no backend serves a layer.
SimReport run_simulation(const SimOptions& options);

/// Parses a byte size: "512MiB", "1.5GiB", "64KiB", "2GB", "1000000" (bytes); binary
/// (KiB MiB GiB TiB) and decimal (KB MB GB TB) units, case-insensitive. Throws InvalidArgument
/// naming `what` and the text.
int64_t parse_byte_size(std::string_view text, std::string_view what = "size");

}  // namespace pagedattn::sim
