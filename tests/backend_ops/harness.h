// Runs one OpCase on a backend and compares it with the float64 reference.
#pragma once

#include <string>

#include "cases.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/backend.h"

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

/// Generates the case's inputs, runs the backend (write_kv then forward, outputs poisoned
/// first) and checks: the cache bytes it wrote equal the reference's, every output row of a
/// real token was written, and output and LSE are within the budget of docs/testing.md.
CaseResult run_case(const Backend& backend, const OpCase& k, const RunOptions& options = {});

}  // namespace pagedattn::backend_ops
