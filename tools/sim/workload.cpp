#include "sim/workload.h"

#include <algorithm>
#include <cmath>

#include "pagedattn/error.h"

namespace pagedattn::sim {

using detail::require;

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Rng::uniform() {
  return double(next() >> 11) * 0x1.0p-53;
}

int64_t Rng::uniform_int(int64_t lo, int64_t hi) {
  const uint64_t span = uint64_t(hi - lo) + 1;
  return lo + int64_t(span == 0 ? next() : next() % span);
}

double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1]: log stays finite
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

void WorkloadOptions::validate() const {
  require(num_requests >= 1, "--num-requests (", num_requests, ") must be >= 1");
  require(prompt_len_median >= 1, "--prompt-len (", prompt_len_median, ") must be >= 1");
  require(output_len_median >= 1, "--output-len (", output_len_median, ") must be >= 1");
  require(prompt_len_sigma >= 0 && output_len_sigma >= 0, "length sigmas (", prompt_len_sigma, ", ",
          output_len_sigma, ") must be >= 0");
  require(shared_prefix_fraction >= 0 && shared_prefix_fraction <= 1, "--shared-prefix-fraction (",
          shared_prefix_fraction, ") must be in [0, 1]");
  require(num_shared_prefixes >= 1, "--num-shared-prefixes (", num_shared_prefixes,
          ") must be >= 1");
  require(arrival_rate >= 0 && std::isfinite(arrival_rate), "--arrival-rate (", arrival_rate,
          ") must be a finite number >= 0");
  require(max_model_len >= 2, "max_model_len (", max_model_len,
          ") must be >= 2 (one prompt token and one generated token)");
  require(vocab_size >= 2, "vocab_size (", vocab_size, ") must be >= 2");
}

namespace {

// A log-normal length with this median, rounded and clamped to [lo, hi].
int64_t draw_length(Rng& rng, double median, double sigma, int64_t lo, int64_t hi) {
  const double x = median * std::exp(sigma * rng.normal());
  return std::clamp(int64_t(std::llround(x)), lo, hi);
}

std::vector<int32_t> random_tokens(Rng& rng, int64_t n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& id : t) id = int32_t(rng.uniform_int(0, vocab - 1));
  return t;
}

}  // namespace

std::vector<WorkloadRequest> make_workload(const WorkloadOptions& o) {
  o.validate();
  Rng rng(o.seed ^ 0x5eedf00dull);
  const int64_t m = o.max_model_len;
  std::vector<std::vector<int32_t>> prefixes;
  for (int p = 0; p < o.num_shared_prefixes; ++p) {
    const int64_t len = draw_length(rng, o.prompt_len_median, o.prompt_len_sigma * 0.5, 1, m - 1);
    prefixes.push_back(random_tokens(rng, len, o.vocab_size));
  }
  // Exactly round(fraction * n) requests share a prefix, chosen at random: small workloads
  // then show prefix hits whatever the seed.
  std::vector<int> order(size_t(o.num_requests));
  for (int i = 0; i < o.num_requests; ++i) order[size_t(i)] = i;
  for (int i = o.num_requests - 1; i > 0; --i) {
    std::swap(order[size_t(i)], order[size_t(rng.uniform_int(0, i))]);
  }
  const int num_shared = int(std::lround(o.shared_prefix_fraction * o.num_requests));
  std::vector<char> shares(size_t(o.num_requests), 0);
  for (int i = 0; i < num_shared; ++i) shares[size_t(order[size_t(i)])] = 1;

  std::vector<WorkloadRequest> requests;
  double clock = 0;
  for (int i = 0; i < o.num_requests; ++i) {
    WorkloadRequest r;
    r.id = i;
    if (o.arrival_rate > 0 && i > 0) clock += -std::log(1.0 - rng.uniform()) / o.arrival_rate;
    r.arrival_step = int(clock);
    r.output_len = int(draw_length(rng, o.output_len_median, o.output_len_sigma, 1, m - 1));
    const int64_t max_prompt = m - r.output_len;
    if (shares[size_t(i)]) {
      // A system prompt, then the user's part (about half a prompt).
      r.shared_prefix = int(rng.uniform_int(0, o.num_shared_prefixes - 1));
      const std::vector<int32_t>& prefix = prefixes[size_t(r.shared_prefix)];
      const int64_t suffix =
          draw_length(rng, o.prompt_len_median * 0.5, o.prompt_len_sigma, 1, max_prompt);
      r.prompt.assign(prefix.begin(),
                      prefix.begin() + std::min<int64_t>(int64_t(prefix.size()), max_prompt - 1));
      const std::vector<int32_t> own =
          random_tokens(rng, std::min(suffix, max_prompt - int64_t(r.prompt.size())), o.vocab_size);
      r.prompt.insert(r.prompt.end(), own.begin(), own.end());
    } else {
      const int64_t len = draw_length(rng, o.prompt_len_median, o.prompt_len_sigma, 1, max_prompt);
      r.prompt = random_tokens(rng, len, o.vocab_size);
    }
    requests.push_back(std::move(r));
  }
  return requests;
}

int32_t sample_token(uint64_t seed, int request_id, int64_t position, int vocab_size) {
  Rng rng(seed * 0x100000001b3ull ^ (uint64_t(request_id) << 32) ^ uint64_t(position));
  rng.next();
  return int32_t(rng.uniform_int(0, vocab_size - 1));
}

}  // namespace pagedattn::sim
