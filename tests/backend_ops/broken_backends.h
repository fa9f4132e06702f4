// Deliberately wrong test-only backends: the reference with one bug each. The harness must
// fail every one of them on some case of the matrix, or it could not catch that bug either.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn::backend_ops {

enum class Bug {
  kIgnoresCausalMask,  ///< decoder queries see future tokens
  kWindowOffByOne,     ///< one key more than the window allows
  kIgnoresSoftCap,
  kAlibiSignFlipped,
  kIgnoresSinks,
  kScaleOffByTwoPercent,
  kIgnoresFp8Scales,  ///< reads fp8 values without multiplying by k/v scale
  kWrongGqaMapping,   ///< query head h reads KV head (H-1-h)/G instead of h/G
  kWritesNextSlot,    ///< write_kv stores every token one slot too far
  kSkipsLastRow,      ///< leaves the last real token's output unwritten
  kLseOffByOnePercent,
  kHeadZeroScales,  ///< per-head scales: every head (and sequence) uses element 0
};

std::vector<Bug> all_bugs();
std::string bug_name(Bug bug);
std::unique_ptr<Backend> make_broken_backend(Bug bug);

}  // namespace pagedattn::backend_ops
