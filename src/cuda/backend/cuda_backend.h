// The `cuda` backend: write_kv, paged attention (decode kernels with split-KV), merge_states
// and amax on NVIDIA Hopper GPUs.
#pragma once

#include <climits>
#include <memory>

#include "cuda/mla/config.h"
#include "pagedattn/backend.h"

namespace pagedattn::cuda {

/// Environment variable that turns checked mode on for the registered backend ("1").
inline constexpr const char* kCheckedEnvVar = "PAGEDATTN_CHECKED";
/// Environment variable that forces the KV split count of every step (1..64; tests, benchmarks).
inline constexpr const char* kSplitsEnvVar = "PAGEDATTN_CUDA_SPLITS";
/// Environment variable that routes rows between the decode and prefill kernels:
/// auto (default), off (the decode kernel takes every row), all (the prefill kernel does).
inline constexpr const char* kPrefillEnvVar = "PAGEDATTN_CUDA_PREFILL";
/// Environment variable that picks the prefill kernel: auto (default: the Hopper kernel on
/// sm_90 where compiled) or portable (the mma.sync kernel everywhere; tests, comparisons).
inline constexpr const char* kPrefillKernelEnvVar = "PAGEDATTN_CUDA_PREFILL_KERNEL";
/// Environment variable that picks how the decode kernel copies K/V rows into shared memory:
/// auto (default: bulk for rows of >= kBulkMinRowBytes on sm_90, else cp.async), bulk (sm_90:
/// one cp.async.bulk per row, completion on an mbarrier) or cp.async (16-byte copies by every
/// lane); tests and comparisons run all.
inline constexpr const char* kDecodeCopyEnvVar = "PAGEDATTN_CUDA_DECODE_COPY";
/// Environment variable that picks the MLA kernel variant (head size 576): auto (default:
/// mla::default_consumer(), per cache kind and head count, and swap-ab / swap-ab-32 for steps
/// whose requests have at most 16 / 32 packed rows), split-s (S split between the consumer
/// warpgroups, P shared through smem; 1.2-1.4x faster on the H200 than redundant), redundant
/// (both warpgroups compute the whole S; kept as a comparison), seesaw (each warpgroup owns
/// alternate tiles and half of O; 16-bit caches only), swap-ab (16-row CTAs with the products
/// transposed; the 512 latent columns only) or swap-ab-32 (the same with 32-row CTAs).
inline constexpr const char* kMlaEnvVar = "PAGEDATTN_CUDA_MLA";
/// Environment variable for how the MLA kernel brings the full tiles of a 16-bit latent cache:
/// auto (TMA when the block size is a multiple of 64: one box per panel; measured on the H200
/// as fast as cp.async there, and 6% slower at block size 16, where a tile takes 36 boxes from
/// one thread), tma (also at block sizes that are multiples of 16) or cp.async (row gathers).
inline constexpr const char* kMlaCopyEnvVar = "PAGEDATTN_CUDA_MLA_COPY";
/// Environment variable for how an MLA step's KV splits merge: auto (default: inside one
/// thread-block cluster through distributed shared memory where the kernel does it, swap AB's,
/// and the splits are at most mla::kMaxClusterSplits; else float partials and the combine
/// kernel) or kernel (always the partials and the combine: comparisons).
inline constexpr const char* kMlaMergeEnvVar = "PAGEDATTN_CUDA_MLA_MERGE";
/// Environment variable for layers with query_quant over an e4m3 cache: on (default: the Hopper
/// prefill kernel runs QK^T and P V as fp8 wgmma where compiled) or off (the 16-bit kernel
/// reads the quantised query; comparisons).
inline constexpr const char* kFp8MathEnvVar = "PAGEDATTN_CUDA_FP8_MATH";
/// Environment variable for how the Hopper prefill kernel brings full K/V tiles of a 16-bit
/// cache (head sizes that are multiples of 64): tma (default: one box per block and panel when a
/// block holds a power of two >= 8 rows, and for the key/value tensors of encoder types) or
/// cp.async (row gathers by the producer's K and V halves). Measured on the H200 at block size
/// 16 with the producer split [bench/results/2026-12-04-h200-pingpong-cee695b.txt]: cp.async
/// 0.72-0.93x TMA (d128 0.79-0.84x, d256 0.81-0.84x, d64 0.91-0.93x, chunked 0.72-0.75x).
/// The same switch takes Q's tiles (over a 16-bit cache) by TMA or by cp.async
/// [bench/results/2026-12-04-h200-qtma.txt: TMA d128 1k +16%, 4k +6%, d256 4k +6%].
inline constexpr const char* kPrefillCopyEnvVar = "PAGEDATTN_CUDA_PREFILL_COPY";
/// Environment variable for the Hopper prefill kernel's pingpong between its consumer
/// warpgroups: a CTA with at least this many K/V tiles takes turns (an integer >= 1), or off.
inline constexpr const char* kPingpongEnvVar = "PAGEDATTN_CUDA_PINGPONG_MIN_TILES";
/// The default of kPingpongEnvVar: every CTA. Measured [H200, same binary and call,
/// bench/results/2026-12-04-h200-pingpong-cee695b.txt] against thresholds of 32 / 64 / 128 tiles
/// and off (all within 1% of each other): d128 1k-4k +3%, d64 4k +7%, ViT d64 +7-9%, chunked
/// q1024 over 8k +4%, elsewhere -1 to +2%.
inline constexpr int kPingpongMinTiles = 1;
/// Environment variable for the Hopper prefill kernel's grid: on (as many CTAs as are resident,
/// each walking several work tiles and loading the next one's Q and K while it stores the
/// current one's rows), an integer N >= 1 (at most N CTAs: tests walk every work tile of a
/// launch through one CTA with 1) or off (one CTA per work tile). Default: kPrefillPersistent.
inline constexpr const char* kPersistentEnvVar = "PAGEDATTN_CUDA_PREFILL_PERSISTENT";
/// The default of kPersistentEnvVar: on (INT_MAX CTAs, i.e. as many as are resident). Measured
/// [H200, same binary and call, bench/results/2026-12-04-h200-persistent.txt] against one CTA per
/// work tile: causal d128 1k +13%, 4k +3%; d64 1k +30%, 4k +9%, 16k +3%; ViT +14-27%; fp8
/// products at 4k +7-14%; chunked prefill equal; d256 16k -3% (its Q is not double-buffered).
inline constexpr int kPrefillPersistent = INT_MAX;
/// Environment variable for the order in which the prefill kernels walk their work tiles: the
/// (request, KV head) pairs in groups of N (an integer >= 1), the q tiles longest first within
/// a group, so that the CTAs running at once read one group's K/V and find it in L2; all (one
/// group: every pair's q tile of one length, then the next length); or auto (the default: as
/// many pairs as fit kPrefillL2Share of the L2 at max_seq_len keys, at least
/// kPrefillMinPairGroup). Measured [H200, same binary and call,
/// bench/results/2026-12-04-h200-epilogue.txt] against all: causal d128 1k +8%, 2k +4%, 4k +2%,
/// d256 4k +2%, ViT s1025 +4-6%, elsewhere within 1%; without the floor (one to three pairs
/// per group at 16k) d128 16k -2% and d256 16k -10%, and a group of 8 at d128 1k -12%: the
/// static snake balances a group of few rounds of work tiles badly (docs/kernel_notes.md).
inline constexpr const char* kPairGroupEnvVar = "PAGEDATTN_CUDA_PREFILL_PAIR_GROUP";
/// Environment variable for how a persistent Hopper prefill grid hands out its work tiles:
/// dynamic (the default: each CTA takes the next one by an atomic counter the layer owns, as soon
/// as its producer is free, in launches whose K/V tiles come by TMA and whose work tiles mostly
/// have rows; the others keep the snake) or static (the snake: CTA b takes number b of even
/// rounds of gridDim.x and number gridDim.x - 1 - b of odd ones, fixed before the launch).
/// Measured [H200, same binary and call, bench/results/2026-12-04-h200-dynamic-d908f9c.txt,
/// call 7] against the snake with its groups: causal d128 1k +3%, 4k +3%, 16k 0%; d64 1k +6%;
/// d256 4k +8%, 16k +4%; ViT d64 +5-6%.
inline constexpr const char* kPrefillWalkEnvVar = "PAGEDATTN_CUDA_PREFILL_WALK";
/// The share of the L2 the auto pair group's K/V may take (static walk).
inline constexpr double kPrefillL2Share = 0.5;
/// The fewest pairs per auto group (static walk).
inline constexpr int kPrefillMinPairGroup = 8;
/// The same under the dynamic walk, which balances small groups: groups of 4 against auto's
/// (0.5, 8) gained 1-3% at d128 1k-16k and d256 4k-16k [H200, call 2 of
/// bench/results/2026-12-04-h200-dynamic-d908f9c.txt].
inline constexpr double kPrefillL2ShareDynamic = 1.0 / 16.0;
inline constexpr int kPrefillMinPairGroupDynamic = 4;

/// How the MLA kernel copies full tiles (kMlaCopyEnvVar).
enum class MlaCopy : uint8_t { kAuto, kTma, kCpAsync };
/// Shortest K/V row (head_size x cache element bytes) the auto choice copies in bulk. Measured
/// [H200, docs/kernel_notes.md v6]: 256-byte rows (bf16 d128) read 2-3% faster in bulk at
/// batch >= 64, 128-byte rows (fp8 d128, bf16 d64) 15-25% slower.
inline constexpr int kBulkMinRowBytes = 256;

enum class DecodeCopy { kAuto, kBulk, kCpAsync };

/// Which kernel takes which request's rows.
enum class PrefillRoute {
  kAuto,  ///< requests with more than prefill::kDecodeMaxRows packed rows: the prefill kernel
  kOff,   ///< the decode kernel only (it q-tiles long queries correctly, slowly)
  kAll,   ///< the prefill kernel only, where one is compiled (tests: every shape through it)
};

struct BackendOptions {
  /// Checked mode: before each launch, copy the step's device metadata (query_start_loc,
  /// seq_lens, block_table, slot_mapping) to the host, synchronising the stream, and run
  /// validate_metadata on it; write_kv checks every slot. Slow and not capturable in a graph.
  /// Off (the default), the kernels trust the metadata as docs/kernel_notes.md lists.
  bool checked = false;
  /// > 0: every plan uses this many KV splits instead of the heuristic's choice.
  int num_splits = 0;
  PrefillRoute prefill = PrefillRoute::kAuto;
  bool portable_prefill = false;               ///< the mma.sync prefill kernel even on Hopper
  DecodeCopy decode_copy = DecodeCopy::kAuto;  ///< how decode brings K/V rows into smem
  mla::Consumer mla_consumer = mla::Consumer::kAuto;  ///< the MLA variant (kMlaEnvVar)
  MlaCopy mla_copy = MlaCopy::kAuto;  ///< the MLA kernel's tile copies (kMlaCopyEnvVar)
  bool mla_cluster_merge =
      true;              ///< MLA splits merge in a cluster where possible (kMlaMergeEnvVar)
  bool fp8_math = true;  ///< query_quant: fp8 products (kFp8MathEnvVar)
  bool prefill_tma =
      true;  ///< Hopper prefill: full tiles by TMA where possible (kPrefillCopyEnvVar)
  /// Hopper prefill: CTAs with at least this many tiles run the pingpong (kPingpongEnvVar;
  /// INT_MAX: never).
  int pingpong_min_tiles = kPingpongMinTiles;
  /// Hopper prefill: at most this many persistent CTAs (kPersistentEnvVar; INT_MAX: as many as
  /// are resident; 0: one CTA per work tile).
  int prefill_persistent = kPrefillPersistent;
  /// Prefill kernels: (request, KV head) pairs per group of the work-tile walk
  /// (kPairGroupEnvVar; 0: auto, INT_MAX: all in one group).
  int prefill_pair_group = 0;
  /// Hopper prefill, persistent grid: work tiles taken by an atomic counter (kPrefillWalkEnvVar;
  /// false: the static snake).
  bool prefill_dynamic = true;
};

/// Options from PAGEDATTN_CHECKED, PAGEDATTN_CUDA_SPLITS, PAGEDATTN_CUDA_PREFILL,
/// PAGEDATTN_CUDA_PREFILL_KERNEL, PAGEDATTN_CUDA_DECODE_COPY, PAGEDATTN_CUDA_MLA, the MLA copy,
/// fp8-math, prefill-copy, pingpong, persistent, pair-group and walk variables above.
BackendOptions backend_options_from_env();

std::unique_ptr<Backend> make_backend(const BackendOptions& options = backend_options_from_env());

}  // namespace pagedattn::cuda
