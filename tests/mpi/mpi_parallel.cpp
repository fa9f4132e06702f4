// Tensor parallelism and decode context parallelism across processes (issue 9, CPU ranks), run
// by ctest under mpirun with 2 and 4 processes on loopback.
//
// 1. The backend_ops case matrix (tests/backend_ops/cases.cpp, the same generator and inputs):
//    every case is run sharded on each CPU backend, TP (each rank its heads, outputs gathered)
//    and DCP (each rank its share of the context, the step's new tokens written on their
//    owners, (output, LSE) merged in rank order), and the gathered result is held to the
//    project's accuracy rule against the float64 reference of the whole step
//    (docs/testing.md); each rank's cache after the write must hold the reference's bytes for
//    its heads (TP) or its tokens (DCP). Cases the sharding refuses are counted and listed with
//    the reason.
// 2. Several steps of prefill chunks and decodes through the Attention layer under DCP (the
//    cache carried from step to step), against the single-process layer.
// Every rank computes the references itself and checks the gathered result; shares cross by
// MPI_Allgather.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend_ops/cases.h"
#include "backend_ops/harness.h"
#include "common/parallel_scenarios.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"
#include "ref/ref_backend.h"

namespace {

using namespace pagedattn;
namespace bo = pagedattn::backend_ops;

int rank_ = 0, world_ = 1;
bool verbose_ = false;
// DCP partial outputs in the activation dtype (the layer's and the cuda backend's only choice)
// instead of float32 (which the CPU backends can write): --activation-partials, a measurement.
bool activation_partials_ = false;

// All ranks' buffers of `bytes` each, in rank order.
std::vector<uint8_t> allgather(const void* mine, size_t bytes) {
  std::vector<uint8_t> all(bytes * size_t(world_));
  MPI_Allgather(mine, int(bytes), MPI_BYTE, all.data(), int(bytes), MPI_BYTE, MPI_COMM_WORLD);
  return all;
}

int all_max(int v) {
  int out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

std::string join(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : "; ") + p;
  return s;
}

// Byte equality of two views of the same shape and dtype (any strides).
bool same_bytes(const TensorView& a, const TensorView& b) {
  const Tensor ca = Tensor::copy_of(a, Device::cpu()), cb = Tensor::copy_of(b, Device::cpu());
  return std::memcmp(ca.data(), cb.data(), ca.view().nbytes()) == 0;
}

// The references of one case, computed by every rank.
struct Reference {
  bo::CaseData data;
  Tensor cache0;         // the pre-step cache (storage)
  bo::RunOutputs exact;  // float64
  bo::RunOutputs naive;  // the same algorithm in low precision: sets the error budget
  int64_t num_actual_tokens = 0;
};

Reference make_reference(const bo::OpCase& k) {
  Reference r;
  r.data = bo::make_case_data(k);
  r.cache0 = bo::make_initial_cache(k, r.data);
  const auto ref64 = ref::make_backend(ref::Precision::kFloat64);
  const auto lowp = ref::make_backend(ref::Precision::kLowPrecision);
  r.exact = bo::run_on(*ref64, k, r.data, r.cache0, DType::kF64, DType::kF64, Device::cpu(), 0);
  r.naive = bo::run_on(*lowp, k, r.data, r.cache0, k.config.dtype, DType::kF32, Device::cpu(), 0);
  r.num_actual_tokens = r.data.step.view().num_actual_tokens;
  return r;
}

// The accuracy rule (docs/testing.md) on rows [0, T_a) of output [T, H, D] and LSE [H, T].
std::string check_rule(const Reference& ref, DType dtype, const Tensor& out, const Tensor& lse) {
  const int64_t t_a = ref.num_actual_tokens;
  const auto rows = [t_a](const Tensor& t) { return t.view().slice(0, 0, t_a); };
  const auto cols = [t_a](const Tensor& t) { return t.view().slice(1, 0, t_a); };
  const ErrorStats e = compare(rows(out), rows(ref.exact.output));
  const ErrorStats eb = compare(rows(ref.naive.output), rows(ref.exact.output));
  const ErrorStats l = compare(cols(lse), cols(ref.exact.lse));
  const ErrorStats lb = compare(cols(ref.naive.lse), cols(ref.exact.lse));
  const Tolerance tol = default_tolerance(dtype), lse_tol = default_tolerance(DType::kF32);
  std::string why;
  if (!within_budget(e, eb, tol)) {
    why += detail::cat("output ", e.to_string(), " exceeds ", tol.multiple, " x ", eb.max_abs,
                       " + ", tol.atol, "; ");
  }
  if (!within_budget(l, lb, lse_tol)) {
    why += detail::cat("lse ", l.to_string(), " exceeds ", lse_tol.multiple, " x ", lb.max_abs,
                       " + ", lse_tol.atol, "; ");
  }
  if (verbose_ && why.empty() && rank_ == 0) {
    std::printf("    out %.2e (budget %.2e)  lse %.2e (budget %.2e)\n", e.max_abs, eb.max_abs,
                l.max_abs, lb.max_abs);
  }
  return why;
}

// One rank's share of a case, ready to exchange, or why there is none.
struct Share {
  enum Status { kReady = 0, kRefused = 1, kError = 2 } status = kReady;
  std::string message;  // refusal reasons or the error
  bo::RunOutputs run;
  std::string cache_mismatch;  // non-empty: this rank's cache differs from the reference's
  int64_t owned_tokens = 0;    // DCP: the step's new tokens written on this rank
};

// ---- tensor parallelism: each rank its query heads and KV heads ----

Share tp_share(const Backend& backend, const bo::OpCase& k, Reference& ref,
               TensorParallelShard& shard) {
  Share s;
  const AttentionConfig& c = k.config;
  try {
    shard = TensorParallelShard::of(c.num_heads, c.num_kv_heads, rank_, world_);
  } catch (const InvalidArgument& e) {
    return {Share::kRefused, e.what(), {}, {}};
  }
  bo::OpCase kr = k;
  kr.config = shard_config(c, shard);
  if (const auto why = backend.check({kr.config, Device::cpu()}); !why.empty()) {
    return {Share::kRefused, join(why), {}, {}};
  }
  const int hb = shard.head_begin, kb = shard.kv_head_begin;
  bo::CaseData data = ref.data;
  data.query = Tensor::copy_of(ref.data.query.view().slice(1, hb, hb + shard.num_heads), {});
  data.key = Tensor::copy_of(ref.data.key.view().slice(1, kb, kb + shard.num_kv_heads), {});
  data.value = Tensor::copy_of(ref.data.value.view().slice(1, kb, kb + shard.num_kv_heads), {});
  Tensor cache0;
  const KVCacheLayout layout = c.kv_cache_layout;
  if (uses_kv_cache(c.attn_type)) {
    const KVCache mine = KVCache::allocate(kr.config, ref.data.num_blocks);
    const KVCacheView whole = bo::cache_view_of(ref.cache0, layout);
    copy_tensor(mine.view().key, whole.key.slice(2, kb, kb + shard.num_kv_heads));
    copy_tensor(mine.view().value, whole.value.slice(2, kb, kb + shard.num_kv_heads));
    cache0 = mine.storage();
  }
  s.run = bo::run_on(backend, kr, data, cache0, c.dtype, DType::kF32, Device::cpu(), 0);
  if (cache0.defined()) {
    const KVCacheView got = bo::cache_view_of(s.run.cache, layout);
    const KVCacheView want = bo::cache_view_of(ref.exact.cache, layout);
    if (!same_bytes(got.key, want.key.slice(2, kb, kb + shard.num_kv_heads)) ||
        !same_bytes(got.value, want.value.slice(2, kb, kb + shard.num_kv_heads))) {
      s.cache_mismatch = "the rank's KV heads differ from the reference's cache bytes";
    }
  }
  return s;
}

// Every rank's head columns put back in place: output [T, H, D], LSE [H, T].
void tp_gather(const bo::OpCase& k, const Share& s, int heads_per_rank, Tensor& out, Tensor& lse) {
  const AttentionConfig& c = k.config;
  const int64_t t = s.run.output.view().size(0);
  const size_t out_bytes = s.run.output.view().nbytes(), lse_bytes = s.run.lse.view().nbytes();
  std::vector<uint8_t> all_out = allgather(s.run.output.data(), out_bytes);
  std::vector<uint8_t> all_lse = allgather(s.run.lse.data(), lse_bytes);
  out = Tensor::empty({t, c.num_heads, c.head_size}, c.dtype);
  lse = Tensor::empty({c.num_heads, t}, DType::kF32);
  for (int r = 0; r < world_; ++r) {
    const int64_t h0 = int64_t(r) * heads_per_rank, h1 = h0 + heads_per_rank;
    copy_tensor(out.view().slice(1, h0, h1),
                TensorView::contiguous(all_out.data() + size_t(r) * out_bytes, c.dtype,
                                       {t, heads_per_rank, c.head_size}));
    copy_tensor(lse.view().slice(0, h0, h1),
                TensorView::contiguous(all_lse.data() + size_t(r) * lse_bytes, DType::kF32,
                                       {heads_per_rank, t}));
  }
}

// ---- decode context parallelism: each rank its tokens of every request ----

Share dcp_share(const Backend& backend, const bo::OpCase& k, Reference& ref) {
  const AttentionConfig& c = k.config;
  if (const auto why = DecodeContextParallel::unsupported(c); !why.empty()) {
    return {Share::kRefused, join(why), {}, {}};
  }
  const auto dcp = DecodeContextParallel::of(rank_, world_);
  bo::OpCase kr = k;
  kr.config = dcp_config(c, dcp);
  if (const auto why = backend.check({kr.config, Device::cpu()}); !why.empty()) {
    return {Share::kRefused, join(why), {}, {}};
  }
  Share s;
  const int bs = c.block_size;
  // Local blocks from a shuffled pool (block 0 stays the null block).
  int64_t num_blocks = 1;
  for (const auto& r : k.requests) {
    num_blocks += (dcp.local_len(r.context_len + r.query_len) + bs - 1) / bs;
  }
  std::vector<int32_t> pool(size_t(num_blocks - 1));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), std::mt19937(k.seed + uint32_t(rank_)));
  // The context: each owned position's bytes copied from the reference's pre-step cache, read
  // through the request's block table there (shared prefixes included).
  KVCache mine = KVCache::allocate(kr.config, num_blocks);
  fill_host(mine.tensor(), 9.0);  // garbage in every slot the rank never receives
  const KVCacheView whole = bo::cache_view_of(ref.cache0, c.kv_cache_layout);
  const StepMetadata& global = ref.data.step;
  std::vector<DcpRequest> requests;
  size_t next = 0;
  for (size_t i = 0; i < k.requests.size(); ++i) {
    const bo::RequestShape& r = k.requests[i];
    DcpRequest req{r.context_len, r.query_len, {}};
    for (int64_t b = 0; b < (dcp.local_len(r.context_len + r.query_len) + bs - 1) / bs; ++b) {
      req.local_block_ids.push_back(pool[next++]);
    }
    std::vector<int64_t> slots;
    dcp_prefill_slots(r.context_len, req.local_block_ids, bs, dcp, slots);
    for (int j = 0; j < r.context_len; ++j) {
      if (slots[size_t(j)] < 0) continue;
      const int64_t g =
          int64_t(global.block_table[i * size_t(global.max_blocks_per_seq) + size_t(j / bs)]) * bs +
          j % bs;
      const int64_t l = slots[size_t(j)];
      for (auto [dst, src] :
           {std::pair{mine.view().key, whole.key}, std::pair{mine.view().value, whole.value}}) {
        copy_tensor(dst.select(0, l / bs).select(0, l % bs),
                    src.select(0, g / bs).select(0, g % bs));
      }
    }
    requests.push_back(std::move(req));
  }
  const DcpStep step = dcp_step_metadata(requests, bs, dcp);
  bo::CaseData data = ref.data;
  data.step = step.metadata;
  const DType partial = activation_partials_ ? c.dtype : DType::kF32;
  s.run = bo::run_on(backend, kr, data, mine.storage(), partial, DType::kF32, Device::cpu(), 0);
  dcp_clear_empty_rows(step, s.run.output.view(), s.run.lse.view());
  // The step's new tokens this rank owns hold the reference's bytes at their local slots.
  const KVCacheView got = bo::cache_view_of(s.run.cache, c.kv_cache_layout);
  const KVCacheView want = bo::cache_view_of(ref.exact.cache, c.kv_cache_layout);
  int64_t owned = 0;
  for (size_t t = 0; t < step.metadata.slot_mapping.size(); ++t) {
    const int64_t l = step.metadata.slot_mapping[t], g = global.slot_mapping[t];
    if (l < 0) continue;
    ++owned;
    for (auto [a, b] : {std::pair{got.key, want.key}, std::pair{got.value, want.value}}) {
      if (!same_bytes(a.select(0, l / bs).select(0, l % bs),
                      b.select(0, g / bs).select(0, g % bs))) {
        s.cache_mismatch = detail::cat("new token of row ", t, " at local slot ", l,
                                       " differs from the reference's slot ", g);
      }
    }
  }
  s.owned_tokens = owned;
  return s;
}

// A contiguous host tensor converted element by element to `dtype` (rounded to nearest even).
Tensor converted(const TensorView& v, DType dtype) {
  const Tensor src = Tensor::copy_of(v, Device::cpu());
  Tensor out = Tensor::empty(v.shape_vector(), dtype);
  for (int64_t i = 0; i < v.numel(); ++i) {
    store_element(out.data(), dtype, i, load_element(src.data(), v.dtype, i));
  }
  return out;
}

// Every rank's (output, LSE) merged in rank order in float32, the result rounded once to
// `dtype` (as an engine hands it on). The ranks write float32 partial outputs: each partial
// rounded to bfloat16 adds about one rounding to the result, which sits at the accuracy rule's
// limit (2 ranks, --activation-partials: up to 1.00 of the allowed error; merging in bfloat16
// as well: up to 3.5 times the naive error at 4 ranks, past the rule's 2).
void dcp_merge(const Backend& backend, const Share& s, DType dtype, Tensor& out, Tensor& lse) {
  const TensorView mine = s.run.output.view();
  const size_t out_bytes = mine.nbytes(), lse_bytes = s.run.lse.view().nbytes();
  std::vector<uint8_t> all_out = allgather(s.run.output.data(), out_bytes);
  std::vector<uint8_t> all_lse = allgather(s.run.lse.data(), lse_bytes);
  std::vector<Tensor> outs, lses;
  for (int r = 0; r < world_; ++r) {
    outs.push_back(converted(TensorView::contiguous(all_out.data() + size_t(r) * out_bytes,
                                                    mine.dtype, mine.shape_vector()),
                             DType::kF32));
    lses.push_back(
        Tensor::copy_of(TensorView::contiguous(all_lse.data() + size_t(r) * lse_bytes, DType::kF32,
                                               s.run.lse.view().shape_vector()),
                        Device::cpu()));
  }
  out = converted(test::merge_ranks(backend, outs, lses, &lse).view(), dtype);
}

struct Tally {
  int passed = 0, failed = 0;
  std::map<std::string, std::vector<std::string>> refused;  // reason -> cases
};

// Every case once (its references computed once), then TP and DCP on each backend.
int matrix_checks(const std::vector<const Backend*>& backends,
                  const std::vector<bo::OpCase>& cases) {
  std::vector<std::pair<std::string, Tally>> tallies;  // "TP  cpu", "DCP cpu", ... in order
  for (const Backend* backend : backends) {
    for (const char* mode : {"TP ", "DCP"}) {
      tallies.push_back({std::string(mode) + " " + std::string(backend->name()), {}});
    }
  }
  int failures = 0;
  for (const bo::OpCase& k : cases) {
    Reference ref = make_reference(k);
    size_t next_tally = 0;
    for (const Backend* backend : backends) {
      for (const bool is_tp : {true, false}) {
        auto& [label, tally] = tallies[next_tally++];
        Share s;
        TensorParallelShard shard;
        try {
          s = is_tp ? tp_share(*backend, k, ref, shard) : dcp_share(*backend, k, ref);
        } catch (const std::exception& e) {
          s = {Share::kError, e.what(), {}, {}};
        }
        // Every rank takes the same branch, so that the collectives below stay matched.
        const int status = all_max(int(s.status));
        if (status == Share::kRefused) {
          if (rank_ == 0) {
            tally.refused[s.status == Share::kRefused ? s.message : "(another rank)"].push_back(
                k.name);
          }
          continue;
        }
        std::string why;
        if (status == Share::kError) {
          why = s.status == Share::kError ? "threw: " + s.message : "another rank threw";
        } else {
          Tensor out, lse;
          if (is_tp) {
            tp_gather(k, s, shard.num_heads, out, lse);
          } else {
            dcp_merge(*backend, s, k.config.dtype, out, lse);
            // Every new token is written on exactly one rank (its owner).
            int64_t written = 0;
            MPI_Allreduce(&s.owned_tokens, &written, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
            if (written != ref.num_actual_tokens) {
              why += detail::cat(written, " new tokens written over the ranks; the step has ",
                                 ref.num_actual_tokens, "; ");
            }
          }
          why += check_rule(ref, k.config.dtype, out, lse) + s.cache_mismatch;
        }
        const bool ok = all_max(why.empty() ? 0 : 1) == 0;
        (ok ? tally.passed : tally.failed) += 1;
        failures += !ok && rank_ == 0 ? 1 : 0;  // one count per case
        // Rank 0 reports what every rank sees (the gathered result); a rank reports its own
        // cache or error.
        const bool own = s.status == Share::kError || !s.cache_mismatch.empty();
        if (!why.empty() && (rank_ == 0 || own)) {
          std::printf("[rank %d/%d] FAIL %s %s: %s\n", rank_, world_, label.c_str(), k.name.c_str(),
                      why.c_str());
        } else if (ok && verbose_ && rank_ == 0) {
          std::printf("  ok   %s %s\n", label.c_str(), k.name.c_str());
        }
      }
    }
  }
  if (rank_ == 0) {
    for (const auto& [label, t] : tallies) {
      int refused = 0;
      for (const auto& [reason, names] : t.refused) refused += int(names.size());
      std::printf("%s over %zu backend_ops cases, %d ranks: %d passed, %d failed, %d refused\n",
                  label.c_str(), cases.size(), world_, t.passed, t.failed, refused);
      for (const auto& [reason, names] : t.refused) {
        std::printf("  refused %zu (%s):", names.size(), reason.c_str());
        for (const auto& n : names) std::printf("\n    %s", n.c_str());
        std::printf("\n");
      }
    }
  }
  return failures;
}

// ---- several steps of chunks and decodes through the layer ----

int layer_chunk_checks(const Backend& backend) {
  int failures = 0;
  for (const bool sinks : {false, true}) {
    const test::DcpChunkScenario s = test::make_dcp_chunk_scenario(sinks, sinks ? 52 : 51);
    const std::string name(backend.name());
    std::vector<Tensor> want, want_lse, mine, mine_lse;
    std::string error;
    try {
      test::run_dcp_chunks(s, name, nullptr, want, want_lse);
      const auto dcp = DecodeContextParallel::of(rank_, world_);
      test::run_dcp_chunks(s, name, &dcp, mine, mine_lse);
    } catch (const std::exception& e) {
      error = e.what();
      std::printf("[rank %d/%d] FAIL DCP layer %s sinks %d threw: %s\n", rank_, world_,
                  name.c_str(), int(sinks), e.what());
    }
    if (all_max(error.empty() ? 0 : 1) != 0) {  // no exchange unless every rank has its share
      failures += rank_ == 0 ? 1 : 0;
      continue;
    }
    for (size_t i = 0; i < want.size(); ++i) {
      Share share;
      share.run.output = mine[i];
      share.run.lse = mine_lse[i];
      Tensor merged, merged_lse;
      dcp_merge(backend, share, DType::kF32, merged, merged_lse);
      const ErrorStats e = compare(merged.view(), want[i].view());
      const ErrorStats l = compare(merged_lse.view(), want_lse[i].view());
      // The same backend on the same inputs either way: only the summation order differs.
      const bool ok = e.mismatched_nonfinite == 0 && l.mismatched_nonfinite == 0 &&
                      e.max_abs <= 2e-6 * std::max(1.0, e.max_ref) &&
                      l.max_abs <= 2e-6 * std::max(1.0, l.max_ref);
      if (rank_ == 0 && (!ok || verbose_)) {  // every rank sees the same gathered result
        std::printf("[rank %d/%d] %s DCP layer %s sinks %d step %zu: out %s; lse %s\n", rank_,
                    world_, ok ? "ok  " : "FAIL", name.c_str(), int(sinks), i,
                    e.to_string().c_str(), l.to_string().c_str());
      }
      failures += !ok && rank_ == 0 ? 1 : 0;
    }
  }
  if (rank_ == 0) {
    std::printf("DCP layer %s: 2 scenarios x 4 steps of chunks and decodes, %d ranks\n",
                std::string(backend.name()).c_str(), world_);
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  for (int i = 1; i < argc; ++i) {
    verbose_ = verbose_ || std::string(argv[i]) == "-v";
    activation_partials_ = activation_partials_ || std::string(argv[i]) == "--activation-partials";
  }
  int failures = 0;
  const std::vector<bo::OpCase> cases = bo::make_case_matrix(20261202);
  std::vector<const Backend*> backends;
  for (const Backend* backend : default_registry().backends()) {
    // The CPU backends: those that run the matrix's first (plain) case on the CPU.
    if (backend->check({cases.front().config, Device::cpu()}).empty()) backends.push_back(backend);
  }
  for (const Backend* backend : backends) failures += layer_chunk_checks(*backend);
  failures += matrix_checks(backends, cases);
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank_ == 0) std::printf("mpi_parallel: %d ranks, %d failures\n", world_, total);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
