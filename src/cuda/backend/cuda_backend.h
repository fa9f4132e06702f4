// The `cuda` backend: write_kv, paged attention (decode kernels with split-KV), merge_states
// and amax on NVIDIA Hopper GPUs.
#pragma once

#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "cuda/mla/config.h"
#include "pagedattn/backend.h"

namespace pagedattn::cuda {

/// Environment variable that turns checked mode on for the registered backend (any value but
/// "0"; the option `checked`).
inline constexpr const char* kCheckedEnvVar = "PAGEDATTN_CHECKED";
/// Environment variable holding the registered backend's KV split count (the option `splits`:
/// auto or 1..64), the one tuning knob a user sets through the environment.
inline constexpr const char* kSplitsEnvVar = "PAGEDATTN_CUDA_SPLITS";

/// The persistent prefill grid's default (prefill_persistent=auto): as many CTAs as are
/// resident, each walking several work tiles and loading the next one's Q and K while it stores
/// the current one's rows; faster than one CTA per work tile on every measured shape but d256
/// at 16k tokens (its Q is not double-buffered).
inline constexpr int kPrefillPersistent = INT_MAX;
/// The share of the L2 the auto pair group's K/V may take (static walk): the CTAs running at
/// once read one group's K/V and find it in L2 (2-8% faster than one group of every pair on
/// causal rows of 1k-4k tokens).
inline constexpr double kPrefillL2Share = 0.5;
/// The fewest pairs per auto group (static walk): the snake balances a group of few rounds of
/// work tiles badly (one to three pairs per group at 16k tokens lost 2-10%).
inline constexpr int kPrefillMinPairGroup = 8;
/// The same under the dynamic walk, which balances small groups: groups of 4 gained 1-3% over
/// the static walk's (0.5, 8) at d128 and d256.
inline constexpr double kPrefillL2ShareDynamic = 1.0 / 16.0;
inline constexpr int kPrefillMinPairGroupDynamic = 4;

/// How the MLA kernel copies the full tiles of a 16-bit latent cache: auto (TMA, one box per
/// panel, at block sizes that are multiples of 64; cp.async row gathers elsewhere, where a tile
/// would take many small boxes from one thread) or cp.async (always).
enum class MlaCopy : uint8_t { kAuto, kCpAsync };
/// Shortest K/V row (head_size x cache element bytes) the auto choice copies in bulk: 256-byte
/// rows (bf16 d128) read a few percent faster in bulk at large batches, 128-byte rows (fp8 d128,
/// bf16 d64) 15-25% slower.
inline constexpr int kBulkMinRowBytes = 256;

/// How the decode kernel brings K/V rows into shared memory: auto (bulk for rows of >=
/// kBulkMinRowBytes on sm_90, else cp.async), bulk (one cp.async.bulk per row, completion on an
/// mbarrier) or cp.async (16-byte copies by every lane). Forcing one runs it on every shape.
enum class DecodeCopy : uint8_t { kAuto, kBulk, kCpAsync };

/// Which kernel takes which request's rows.
enum class PrefillRoute : uint8_t {
  kAuto,  ///< requests with more than prefill::kDecodeMaxRows packed rows: the prefill kernel
  kOff,   ///< the decode kernel only (its q-tiled path, which auto runs where no prefill kernel
          ///< is compiled: float32; a comparison)
  kAll,   ///< the prefill kernel only, where one is compiled (tests: every shape through it)
};

/// The cuda backend's options: the kernel variants and the two tuning knobs. Users set them by
/// name through Registry::configure ("prefill=all"; cuda_options.cpp holds the names, values
/// and their parser), tools through --cuda-option; every default is the measured-fastest choice
/// (auto), the other values are test or comparison routes to code paths auto also takes.
struct BackendOptions {
  /// Checked mode: before each launch, copy the step's device metadata (query_start_loc,
  /// seq_lens, block_table, slot_mapping) to the host, synchronising the stream, and run
  /// validate_metadata on it; write_kv checks every slot. Slow and not capturable in a graph.
  /// Off (the default), the kernels trust the metadata.
  bool checked = false;
  /// > 0: every plan uses this many KV splits instead of the heuristic's choice (0).
  int num_splits = 0;
  PrefillRoute prefill = PrefillRoute::kAuto;
  /// The portable (mma.sync) prefill kernel even on Hopper, where auto takes it only for shapes
  /// the Hopper kernel does not serve (a test and comparison route).
  bool portable_prefill = false;
  DecodeCopy decode_copy = DecodeCopy::kAuto;
  /// The MLA kernel variant (head size 576): auto is mla::default_consumer() per cache kind and
  /// head count, and swap AB (16- or 32-row CTAs) for steps whose requests have few rows.
  mla::Consumer mla_consumer = mla::Consumer::kAuto;
  MlaCopy mla_copy = MlaCopy::kAuto;
  /// Hopper prefill: full K/V tiles (and Q's) of a 16-bit cache by TMA where the block size and
  /// strides allow (auto; cp.async otherwise), or false: always by cp.async row gathers.
  bool prefill_tma = true;
  /// Hopper prefill: at most this many persistent CTAs (kPrefillPersistent: as many as are
  /// resident; tests walk every work tile of a launch through one CTA with 1).
  int prefill_persistent = kPrefillPersistent;
  /// Prefill kernels: (request, KV head) pairs per group of the work-tile walk (0: auto, as
  /// many as fit kPrefillL2Share of the L2 at max_seq_len keys; tests: small groups).
  int prefill_pair_group = 0;
  /// Hopper prefill, persistent grid: work tiles taken by an atomic counter where the dynamic
  /// walk pays (prefill::dynamic_walk_pays, K/V by TMA), the static snake elsewhere (true,
  /// auto); false: the static snake always.
  bool prefill_dynamic = true;
  /// fp8 caches: k / v scales that differ between KV heads on the attention kernels (the
  /// per-head factors of AttnParams::head_scales). Off (the default) refuses them with a reason,
  /// as every build did before the kernels took them: the path has not yet run on a GPU
  /// (tests/cuda CudaDecode.PerHeadScalesRunPerKvHead turns it on to check it there).
  bool head_scales = false;
  /// V narrower than K (AttentionConfig::v_head_size) on the attention kernels, on K's instance
  /// with V's columns past v_head_size zero in shared memory. Off (the default) refuses it with
  /// a reason, as every build did before the kernels took it: the path has not yet run on a GPU
  /// (bench/gpu/head_sizes.sh runs backend_ops' v_head cases with it on).
  bool v_head = false;
  /// The portable kernels on every device, Hopper too (no bulk copies, TMA, wgmma prefill or MLA
  /// latent kernel): what Ampere, Ada and later GPUs run, forced for tests and comparisons.
  bool portable = false;
};

/// Whether `device` runs the Hopper code under `options`: the build has it, the device is
/// compute capability 9.0 and the option kernels=portable is off.
bool hopper_route(int device, const BackendOptions& options);
/// One line: which kernel family serves `device` under `options`, and why (`pagedattn backends`).
std::string device_family(int device, const BackendOptions& options);

/// The defaults with the user's environment: checked mode from PAGEDATTN_CHECKED, the split
/// count from PAGEDATTN_CUDA_SPLITS (throws InvalidArgument naming the variable for a bad value).
BackendOptions backend_options_from_env();
/// `options` with "name=value" settings applied in order (the one parser of the option names
/// and values). Throws InvalidArgument naming the option, the value and what is allowed.
BackendOptions apply_settings(const BackendOptions& options,
                              const std::vector<std::string>& settings);
/// Every option with its value in `options` (Backend::options()).
std::vector<BackendOptionInfo> describe_options(const BackendOptions& options);

std::unique_ptr<Backend> make_backend(const BackendOptions& options = backend_options_from_env());

}  // namespace pagedattn::cuda
