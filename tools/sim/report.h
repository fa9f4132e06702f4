// The final report of `pagedattn run`: a text summary and the same figures as JSON.
#pragma once

#include <string>

#include "sim/simulation.h"

namespace pagedattn::sim {

/// A human-readable summary, one figure per line.
std::string format_report(const SimReport& report);
/// The same figures as a JSON object (pretty-printed, newline-terminated).
std::string report_json(const SimReport& report);
/// "512.0 MiB", "3.2 GiB", "812 B".
std::string format_bytes(double bytes);

/// What a run with a KV connector did not do that it was asked to: saves scheduled and none
/// written ("failed": the run exits non-zero), or, for a decode (consumer), lookups that found
/// nothing (a warning: the store may be missing, unreachable or empty). Empty when neither.
struct ConnectorShortfall {
  std::string message;
  bool failed = false;
};
ConnectorShortfall connector_shortfall(const SimReport& report);

}  // namespace pagedattn::sim
