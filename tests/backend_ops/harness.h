// Runs one OpCase on a backend and compares it with the float64 reference.
#pragma once

#include <optional>
#include <string>

#include "cases.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/backend.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"

namespace pagedattn::backend_ops {

struct CaseResult {
  bool supported = true;  ///< false: the backend's check() refused (reasons in `message`)
  bool passed = false;
  std::string message;       ///< why it failed, or the refusal reasons
  ErrorStats output_error;   ///< backend vs float64
  ErrorStats output_budget;  ///< naive low precision vs float64 (sets the budget)
  ErrorStats lse_error;
  ErrorStats lse_budget;
  double seconds = 0;  ///< wall time of the backend's forward (perf mode)
};

struct RunOptions {
  Device device{};
  int perf_repeats = 0;  ///< > 0: time the forward this many times (median)
};

/// Everything one case needs, on the host.
struct CaseData {
  StepMetadata step;
  Tensor query, key, value;            // query [T, Hq, D]; key/value [T or encoder tokens, Hkv, D]
  Tensor context_key, context_value;   // [num_context_slots, Hkv, D]
  std::vector<int64_t> context_slots;  // where the earlier steps' K/V live
  int64_t num_blocks = 0;
  int64_t num_query_rows = 0;
};

/// The case's inputs, drawn from its seed: metadata over a shuffled block pool, Q/K/V rows and
/// the context K/V of earlier steps.
CaseData make_case_data(const OpCase& k);

/// The pre-step cache (its storage, in the case's physical layout): the context tokens written
/// by the reference (the oracle's own writer). Undefined for types without a cache.
Tensor make_initial_cache(const OpCase& k, CaseData& data);

/// The logical cache view of a storage tensor in `layout` (HND storage seen through permuted
/// strides); `latent`: the value view is the key view (one entry as K and V).
KVCacheView cache_view_of(const Tensor& storage, KVCacheLayout layout, bool latent = false);
/// The same for a cache of `c`'s shape, a V head size of its own included (separate K and V
/// pages: split_cache_view).
KVCacheView cache_view_of(const Tensor& storage, const AttentionConfig& c, bool latent = false);

struct RunOutputs {
  Tensor output, lse;  // host
  Tensor cache;        // host copy of the combined cache after the write (cached types)
  double seconds = 0;
};

/// Runs the case on `backend` on `device`: copies the pre-step cache `cache0` in, writes the
/// step's K/V with the backend's own write_kv, runs the forward into a poisoned output
/// ([T, H, D] of `out_dtype`) and LSE ([H, T] of `lse_dtype`); `repeats` > 0 also times it.
RunOutputs run_on(const Backend& backend, const OpCase& k, CaseData& data, const Tensor& cache0,
                  DType out_dtype, DType lse_dtype, Device device, int repeats);

/// A case's inputs and the two reference runs that every backend is measured against: the
/// float64 oracle and the naive low-precision run that sets the error budget. Built once per
/// case and shared by every backend (and SIMD target) the case runs on.
struct CaseOracle {
  CaseData data;
  Tensor cache0;     ///< the pre-step cache (make_initial_cache)
  RunOutputs exact;  ///< ref in float64
  RunOutputs naive;  ///< ref in the case's low precision
};
CaseOracle make_oracle(const OpCase& k);

/// Runs the backend on the case's inputs (write_kv then forward, outputs poisoned first) and
/// checks: the cache bytes it wrote equal the reference's, every output row of a real token was
/// written, and output and LSE are within the budget of docs/testing.md. `oracle` is built on
/// first use when empty (a case every backend refuses never pays for its references).
CaseResult run_case(const Backend& backend, const OpCase& k, std::optional<CaseOracle>& oracle,
                    const RunOptions& options = {});
/// The checks of run_case on outputs already computed (`got`, e.g. the oracle's own naive run).
CaseResult check_run(const OpCase& k, const CaseOracle& oracle, const RunOutputs& got);
/// The same with an oracle of its own.
CaseResult run_case(const Backend& backend, const OpCase& k, const RunOptions& options = {});

}  // namespace pagedattn::backend_ops
