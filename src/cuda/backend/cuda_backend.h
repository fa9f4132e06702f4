// The `cuda` backend: write_kv, paged attention (decode kernels with split-KV), merge_states
// and amax on NVIDIA Hopper GPUs.
#pragma once

#include <memory>

#include "pagedattn/backend.h"

namespace pagedattn::cuda {

/// Environment variable that turns checked mode on for the registered backend ("1").
inline constexpr const char* kCheckedEnvVar = "PAGEDATTN_CHECKED";
/// Environment variable that forces the KV split count of every step (1..64; tests, benchmarks).
inline constexpr const char* kSplitsEnvVar = "PAGEDATTN_CUDA_SPLITS";

struct BackendOptions {
  /// Checked mode: before each launch, copy the step's device metadata (query_start_loc,
  /// seq_lens, block_table, slot_mapping) to the host, synchronising the stream, and run
  /// validate_metadata on it; write_kv checks every slot. Slow and not capturable in a graph.
  /// Off (the default), the kernels trust the metadata as docs/kernel_notes.md lists.
  bool checked = false;
  /// > 0: every plan uses this many KV splits instead of the heuristic's choice.
  int num_splits = 0;
};

/// Options from PAGEDATTN_CHECKED and PAGEDATTN_CUDA_SPLITS.
BackendOptions backend_options_from_env();

std::unique_ptr<Backend> make_backend(const BackendOptions& options = backend_options_from_env());

}  // namespace pagedattn::cuda
