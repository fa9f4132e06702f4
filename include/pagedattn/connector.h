// KV connectors (spec section 8): move the paged KV cache of full prompt blocks between engine
// instances. The scheduler-side instance decides, per step, which blocks to load from and save
// to an external store; the worker-side instance does the transfers from inside the attention
// layers' forward (wait for a layer's load before its attention, save it after). Disaggregated
// prefill (one instance prefills, another decodes) and KV caches shared across machines are
// built on it. docs/connector.md describes the built-in connectors and their file format.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/config.h"
#include "pagedattn/dtype.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"

namespace pagedattn {

class ForwardContext;

// ---------------------------------------------------------------------------------------------
// Block hashing: one implementation for prefix caching and for connector keys.

/// The parent hash of a request's first block.
inline constexpr uint64_t kNoParentHash = 0x6a09e667f3bcc909ull;

/// Hash of one full block: (parent block's hash, the block's token ids), so a block's hash names
/// its whole prefix, as in vLLM's prefix caching. FNV-1a over the parent hash, the token count
/// and the token ids (each as 8 little-endian bytes), then a splitmix64 finaliser; the same
/// value on every platform and in every process (it keys external stores).
uint64_t hash_block_tokens(uint64_t parent_hash, std::span<const int32_t> token_ids);

/// Appends to `hashes` the chain hashes of the full blocks of `token_ids` past the ones it
/// already holds (block j covers tokens [j*block_size, (j+1)*block_size)).
void extend_block_hashes(std::vector<uint64_t>& hashes, std::span<const int32_t> token_ids,
                         int block_size);

// ---------------------------------------------------------------------------------------------
// Configuration.

/// Which half of the connector an instance is (spec 8.1).
enum class KVConnectorRole { kScheduler, kWorker };
std::string_view to_string(KVConnectorRole role);

/// What an engine does with the external store (vLLM's kv_role): a producer (prefill instance)
/// only saves, a consumer (decode instance) only loads, kBoth does both.
enum class KVTransferRole { kProducer, kConsumer, kBoth };
std::string_view to_string(KVTransferRole role);
/// Parses "producer" | "prefill" | "consumer" | "decode" | "both"; throws InvalidArgument.
KVTransferRole parse_kv_transfer_role(std::string_view name);

/// One attention layer whose cache the connector moves.
struct KVConnectorLayer {
  std::string name;        ///< the layer's prefix, as registered in the ForwardContext
  int kv_cache_group = 0;  ///< which block table (KV-cache group) addresses its cache
};

/// Everything a connector is built from: where the store is, and the model whose KV it holds.
/// Entries are namespaced by (model, cache dtype, shape) and every field is checked again when
/// an entry is loaded, so a mismatched entry is never read into a cache.
struct KVConnectorConfig {
  std::string name;     ///< registry name: "storage", "redis"
  std::string address;  ///< storage: a directory; redis: "host:port[/db]"
  /// Connector options ("key=value" after '?' in a spec), e.g. fsync=0, io_threads=4,
  /// timeout_ms=500, password=...; docs/connector.md lists them.
  std::map<std::string, std::string> options;
  KVTransferRole kv_role = KVTransferRole::kBoth;

  std::string model;  ///< model identity (weights), part of the namespace; non-empty
  std::vector<KVConnectorLayer> layers;  ///< in model order; names unique
  int block_size = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  DType cache_dtype = DType::kBF16;  ///< element type of the cache (kv_cache_storage_dtype)
  /// Warnings (unreachable store, rejected entries) go here; unset = silent. Called from the
  /// connector's threads, one call at a time per connector.
  std::function<void(std::string_view)> log;

  /// Throws InvalidArgument naming the field, its value and the bound.
  void validate() const;
  /// The store namespace: "<model>/<kv_cache_dtype>-<dtype>/L<layers>-H<kv heads>-D<head size>-
  /// B<block size>" with unsafe characters of the model replaced (plus a hash of the original).
  std::string namespace_name() const;
  /// An option's value, or `fallback`.
  std::string option(std::string_view key, std::string_view fallback = {}) const;
  /// An integer option in [lo, hi]; throws InvalidArgument naming the option and the bound.
  int64_t int_option(std::string_view key, int64_t fallback, int64_t lo, int64_t hi) const;
};

/// Parses a connector spec into name, address and options (the model fields stay unset):
/// "storage:/path/to/dir", "storage:/dir?fsync=0&io_threads=4", "redis://host:port",
/// "redis://:password@host:port/2?timeout_ms=500". Throws InvalidArgument naming the spec.
KVConnectorConfig parse_kv_connector_spec(std::string_view spec);
/// The spec with any password replaced by "***", for logs and reports.
std::string redact_kv_connector_spec(std::string_view spec);

// ---------------------------------------------------------------------------------------------
// What the scheduler tells the scheduler-side connector.

/// A request as the connector sees it (views into the scheduler's request, valid for the call).
struct KVConnectorRequest {
  int request_id = 0;
  std::span<const int32_t> token_ids;  ///< prompt, then the generated tokens
  int num_prompt_tokens = 0;
  /// Tokens already in the local cache (computed, or a local prefix-cache hit).
  int num_computed_tokens = 0;
  /// Chain hashes of the full blocks known so far (may be shorter than the tokens allow, or
  /// empty: the connector computes the rest with extend_block_hashes).
  std::span<const uint64_t> block_hashes;
};

/// get_num_new_matched_tokens' answer (spec 8.3).
struct KVConnectorMatch {
  /// Tokens past num_computed_tokens that the store can provide (a multiple of block_size);
  /// nullopt = "ask again later".
  std::optional<int> num_tokens = 0;
  bool load_async = false;  ///< loads between steps (false: during the next step's forward)
};

/// One request of a step, after allocation.
struct KVConnectorScheduledRequest {
  KVConnectorRequest request;
  std::span<const std::vector<int32_t>> block_ids;  ///< [group] the request's block table row
  int num_computed_tokens = 0;  ///< cached before this step, external tokens included
  int num_new_tokens = 0;       ///< computed this step
};

/// The parts of a scheduler step a connector reads (spec 8.3's SchedulerOutput).
struct KVConnectorSchedulerOutput {
  std::vector<KVConnectorScheduledRequest> requests;
};

/// Per-step instructions from the scheduler-side to the worker-side instance. Each connector
/// defines its own; the worker checks the type it receives.
class KVConnectorMetadata {
 public:
  virtual ~KVConnectorMetadata() = default;
};

/// Counters of one connector instance (scheduler-side and worker-side fields are filled by the
/// instance of that role). "Blocks" are full prompt blocks of one request; bytes cover every
/// layer of a block.
struct KVConnectorStats {
  // Scheduler side.
  int64_t lookups = 0;         ///< get_num_new_matched_tokens calls that asked the store
  int64_t lookup_blocks = 0;   ///< blocks asked about
  int64_t hit_blocks = 0;      ///< blocks the store held (loads scheduled)
  int64_t miss_blocks = 0;     ///< blocks asked about and not held
  int64_t lookup_errors = 0;   ///< lookups that could not reach the store (counted as misses)
  int64_t save_scheduled = 0;  ///< blocks scheduled for saving
  int64_t save_not_held = 0;   ///< blocks not saved: a window group had released them
  // Worker side.
  int64_t loaded_blocks = 0;       ///< blocks read into the cache, every layer verified
  int64_t rejected_blocks = 0;     ///< present but torn, truncated or mismatched: never read in
  int64_t missing_blocks = 0;      ///< gone between lookup and load (evicted, deleted)
  int64_t unavailable_blocks = 0;  ///< the store could not be reached when loading
  int64_t saved_blocks = 0;        ///< entries written (committed)
  int64_t save_errors = 0;         ///< entries that could not be written
  int64_t save_dropped = 0;        ///< entries dropped because a layer was never saved
  int64_t loaded_bytes = 0, saved_bytes = 0;
  double load_seconds = 0;  ///< worker-thread time spent loading (reads, checks, copies)
  double save_seconds = 0;  ///< worker-thread time spent saving (copies, serialising, writes)

  /// Adds every counter of `other`.
  KVConnectorStats& operator+=(const KVConnectorStats& other);
};

// ---------------------------------------------------------------------------------------------
// The connector.

/// vLLM's KVConnectorBase_V1 for C++ engines. One class serves both roles; an instance is
/// built for one. Worker-side hooks are called by Attention::forward through the
/// ForwardContext (only when a connector is set and holds this step's metadata, so an engine
/// without one pays a null check); scheduler-side hooks are called by the engine's scheduler.
///
/// Per step, worker side: bind_connector_metadata(meta); ForwardContext::begin_step calls
/// start_load_kv; each layer calls wait_for_layer_load(name) before its attention and
/// save_kv_layer(...) after it; ForwardContext::end_step calls wait_for_save();
/// get_block_ids_with_load_errors(); clear_connector_metadata(). Blocks whose load failed hold
/// no valid data: the engine must recompute from the first failed block of each request (and
/// discard that request's outputs of the step).
///
/// Errors of the store (unreachable, torn entries) are never thrown: they become misses, load
/// errors and counters. Programming errors (wrong metadata type, unknown role) throw.
class KVConnector {
 public:
  KVConnector(KVConnectorConfig config, KVConnectorRole role);
  virtual ~KVConnector();
  KVConnector(const KVConnector&) = delete;
  KVConnector& operator=(const KVConnector&) = delete;

  /// The registry name ("storage", "redis").
  virtual std::string_view name() const = 0;
  const KVConnectorConfig& config() const { return config_; }
  KVConnectorRole role() const { return role_; }

  // --- Worker side (spec 8.2) -----------------------------------------------------------------

  /// Binds this step's metadata (built by the scheduler-side instance).
  virtual void bind_connector_metadata(std::shared_ptr<const KVConnectorMetadata> metadata);
  /// Drops this step's metadata after the step's transfers have settled.
  virtual void clear_connector_metadata();
  bool has_connector_metadata() const { return metadata_ != nullptr; }
  const KVConnectorMetadata* connector_metadata() const { return metadata_.get(); }

  /// Optional: the caches by layer name, once after allocation.
  virtual void register_kv_caches(const std::map<std::string, KVCacheView>& caches);
  /// Starts loading this step's blocks into the layers' caches (asynchronously).
  virtual void start_load_kv(ForwardContext& context) = 0;
  /// Blocks until `layer_name`'s part of this step's loads is in its cache (or has failed).
  virtual void wait_for_layer_load(std::string_view layer_name) = 0;
  /// Starts saving this step's blocks of one layer; called after the layer's attention, so the
  /// step's new tokens are in `kv_layer`. `scales` are the layer's k/v scales (fp8 caches).
  virtual void save_kv_layer(std::string_view layer_name, const KVCacheView& kv_layer,
                             const AttentionMetadata& metadata, KVScales scales) = 0;
  /// Blocks until every save of this step has been copied out of the caches (their blocks may
  /// then be overwritten or freed); writing to the store may continue in the background.
  virtual void wait_for_save() = 0;
  /// Physical block ids (any group) whose load failed this step: they hold no valid data.
  /// Waits for the step's loads to settle.
  virtual std::vector<int32_t> get_block_ids_with_load_errors();
  /// Waits until everything saved so far is in the store (or failed). Called by the destructor
  /// of the built-in connectors.
  virtual void flush();

  // --- Scheduler side (spec 8.3) --------------------------------------------------------------

  /// Tokens the store holds past `num_computed_tokens` (block-aligned, at most what leaves one
  /// prompt token to compute). Side-effect free; may be called repeatedly.
  virtual KVConnectorMatch get_num_new_matched_tokens(const KVConnectorRequest& request,
                                                      int num_computed_tokens) = 0;
  /// After allocation: `num_external_tokens` tokens from request.num_computed_tokens on will be
  /// loaded into `block_ids` ([group] block table rows) during the next step.
  virtual void update_state_after_alloc(const KVConnectorRequest& request,
                                        std::span<const std::vector<int32_t>> block_ids,
                                        int num_external_tokens) = 0;
  /// This step's metadata; resets the per-step state. Does not modify `output`.
  virtual std::shared_ptr<const KVConnectorMetadata> build_connector_meta(
      const KVConnectorSchedulerOutput& output) = 0;
  /// Feedback from the workers: blocks whose load failed (so they can be saved again once
  /// recomputed).
  virtual void update_connector_output(std::span<const int32_t> invalid_block_ids);
  /// Called once when a request ends, before its blocks are freed. True would mean the
  /// connector frees them later; the built-in connectors copy what they save before
  /// wait_for_save() returns, so they return false.
  virtual bool request_finished(const KVConnectorRequest& request,
                                std::span<const std::vector<int32_t>> block_ids);

  /// Counters so far (the fields of this instance's role).
  virtual KVConnectorStats stats() const = 0;

 private:
  KVConnectorConfig config_;
  KVConnectorRole role_;
  std::shared_ptr<const KVConnectorMetadata> metadata_;
};

// ---------------------------------------------------------------------------------------------
// Registry.

/// Builds a connector of one kind for a config and role.
using KVConnectorFactory =
    std::function<std::unique_ptr<KVConnector>(const KVConnectorConfig&, KVConnectorRole)>;

/// Connectors by name. Explicit registration; the default registry holds "storage" and "redis".
class KVConnectorRegistry {
 public:
  /// Adds a kind; throws InvalidArgument for an empty or duplicate name.
  void add(std::string name, KVConnectorFactory factory);
  /// Names in registration order.
  std::vector<std::string> names() const;
  /// Validates `config` and builds config.name; throws InvalidArgument listing the known names
  /// when there is none of that name, NotSupported when this build lacks it.
  std::unique_ptr<KVConnector> create(const KVConnectorConfig& config, KVConnectorRole role) const;

 private:
  std::vector<std::pair<std::string, KVConnectorFactory>> factories_;
};

/// The process-wide registry with the built-in connectors.
KVConnectorRegistry& default_kv_connector_registry();

/// default_kv_connector_registry().create(config, role).
std::unique_ptr<KVConnector> make_kv_connector(const KVConnectorConfig& config,
                                               KVConnectorRole role);

}  // namespace pagedattn
