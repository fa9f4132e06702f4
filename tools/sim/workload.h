// A seeded synthetic request stream: arrivals over steps, log-normal prompt and output lengths,
// random token ids except for a few shared "system prompts" that prefix caching can reuse.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedattn::sim {

/// A small deterministic generator (splitmix64): the same seed gives the same stream on every
/// platform, which the standard distributions do not promise.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  /// 64 random bits.
  uint64_t next();
  /// Uniform in [0, 1).
  double uniform();
  /// Uniform integer in [lo, hi] (lo <= hi).
  int64_t uniform_int(int64_t lo, int64_t hi);
  /// Standard normal (Box-Muller).
  double normal();

 private:
  uint64_t state_;
};

/// What the request stream looks like.
struct WorkloadOptions {
  uint64_t seed = 0;
  int num_requests = 16;
  double prompt_len_median = 96;  ///< log-normal median of the prompt length, in tokens
  double prompt_len_sigma = 0.7;  ///< log-normal sigma of the prompt length
  double output_len_median = 16;  ///< log-normal median of the generated length
  double output_len_sigma = 0.6;  ///< log-normal sigma of the generated length
  /// Fraction of requests whose prompt starts with one of the shared system prompts (exactly
  /// round(fraction * num_requests) of them, picked at random).
  double shared_prefix_fraction = 0.6;
  int num_shared_prefixes = 3;   ///< distinct system prompts (their length: prompt median)
  double arrival_rate = 2.0;     ///< mean requests per step (exponential gaps); 0 = all at once
  int64_t max_model_len = 2048;  ///< prompt + output never exceed it
  int vocab_size = 32000;        ///< token ids are in [0, vocab_size)

  /// Throws InvalidArgument naming the field, its value and the bound.
  void validate() const;
};

/// One request of the stream.
struct WorkloadRequest {
  int id = 0;                   ///< index in the stream
  int arrival_step = 0;         ///< the first step it may be scheduled in
  std::vector<int32_t> prompt;  ///< token ids
  int output_len = 1;           ///< tokens to generate, >= 1
  int shared_prefix = -1;       ///< which system prompt it starts with, -1 = none
};

/// The requests of `options`, ordered by arrival. Deterministic for a seed.
std::vector<WorkloadRequest> make_workload(const WorkloadOptions& options);

/// The token a request "generates" at `position`: a hash of (seed, request, position), so a
/// run is reproducible whatever the schedule.
int32_t sample_token(uint64_t seed, int request_id, int64_t position, int vocab_size);

}  // namespace pagedattn::sim
