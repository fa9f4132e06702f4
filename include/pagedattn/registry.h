// Backend registry and selector: priority order, override by name, reasons for every refusal.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn {

/// Environment variable naming a backend to use instead of the priority order.
inline constexpr const char* kBackendEnvVar = "PAGEDATTN_BACKEND";

/// One backend's answer to a query.
struct BackendVerdict {
  std::string name;
  std::vector<std::string> reasons;  ///< empty = supported
  bool supported() const { return reasons.empty(); }
};

/// Backends in priority order (first supported wins).
class Registry {
 public:
  /// Adds a backend at the end of the priority order. Names must be unique.
  void add(std::unique_ptr<Backend> backend);
  /// The backend called `name`, or nullptr.
  const Backend* find(std::string_view name) const;
  std::vector<const Backend*> backends() const;
  /// Every backend's verdict on `query`, in priority order.
  std::vector<BackendVerdict> explain(const BackendQuery& query) const;

  /// Picks a backend. `override_name` (or else $PAGEDATTN_BACKEND when `use_env`) forces one:
  /// an unknown name or a refusal throws, never falls back. Otherwise the first supported
  /// backend in priority order; when none fits, throws NotSupported listing every backend with
  /// its reasons.
  const Backend& select(const BackendQuery& query,
                        std::optional<std::string_view> override_name = std::nullopt,
                        bool use_env = true) const;

  /// Replaces the backend called `backend` (same place in the priority order) with
  /// Backend::configured(settings): its current options with `settings` ("name=value" each, e.g.
  /// "prefill=all") applied. Throws InvalidArgument for an unknown backend, option or value,
  /// leaving the registry unchanged; empty `settings` change nothing. The replaced backend
  /// stays alive until the registry is destroyed, so layers and impls built from it keep
  /// working (with its options). Not safe while another thread uses the registry.
  void configure(std::string_view backend, const std::vector<std::string>& settings);

 private:
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::unique_ptr<Backend>> replaced_;  // configure()'s old backends, still referenced
};

/// The process-wide registry holding the built-in backends, in priority order
/// cuda (CUDA tensors), cpu, ref. Registered explicitly on first use.
Registry& default_registry();

/// Formats verdicts as the table `pagedattn backends` prints.
std::string format_verdicts(const std::vector<BackendVerdict>& verdicts);

}  // namespace pagedattn
