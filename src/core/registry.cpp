#include "pagedattn/registry.h"

#include <algorithm>
#include <cstdlib>

#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::require;

namespace {
std::string registered_names(const std::vector<std::unique_ptr<Backend>>& backends) {
  std::string s;
  for (const auto& b : backends) s += (s.empty() ? "" : ", ") + std::string(b->name());
  return s;
}
}  // namespace

void Registry::add(std::unique_ptr<Backend> backend) {
  require(backend != nullptr, "Registry::add: null backend");
  require(find(backend->name()) == nullptr, "Registry::add: a backend named '", backend->name(),
          "' is already registered");
  backends_.push_back(std::move(backend));
}

const Backend* Registry::find(std::string_view name) const {
  for (const auto& b : backends_)
    if (b->name() == name) return b.get();
  return nullptr;
}

void Registry::configure(std::string_view backend, const std::vector<std::string>& settings) {
  auto it = std::find_if(backends_.begin(), backends_.end(),
                         [&](const auto& b) { return b->name() == backend; });
  require(it != backends_.end(), "backend '", backend,
          "' is not a registered backend; valid backends: ", registered_names(backends_));
  if (settings.empty()) return;
  std::unique_ptr<Backend> next = (*it)->configured(settings);
  require(next != nullptr && next->name() == backend, "backend '", backend,
          "': configured() returned no backend of that name");
  replaced_.push_back(std::move(*it));
  *it = std::move(next);
}

std::vector<const Backend*> Registry::backends() const {
  std::vector<const Backend*> out;
  for (const auto& b : backends_) out.push_back(b.get());
  return out;
}

std::vector<BackendVerdict> Registry::explain(const BackendQuery& query) const {
  std::vector<BackendVerdict> out;
  for (const auto& b : backends_) out.push_back({std::string(b->name()), b->check(query)});
  return out;
}

namespace {
std::string describe_query(const BackendQuery& q) {
  const AttentionConfig& c = q.config;
  return cat("device ", to_string(q.device), ", dtype ", dtype_name(c.dtype), ", head_size ",
             c.head_size, ", num_heads ", c.num_heads, "/", c.num_kv_heads, ", kv_cache_dtype ",
             to_string(c.kv_cache_dtype), ", block_size ", c.block_size, ", attn_type ",
             to_string(c.attn_type));
}

std::string join_reasons(const std::vector<std::string>& reasons) {
  std::string s;
  for (const auto& r : reasons) s += (s.empty() ? "" : "; ") + r;
  return s;
}
}  // namespace

const Backend& Registry::select(const BackendQuery& query,
                                std::optional<std::string_view> override_name, bool use_env) const {
  std::string env_name;
  if (!override_name && use_env) {
    if (const char* env = std::getenv(kBackendEnvVar); env && *env) {
      env_name = env;
      override_name = env_name;
    }
  }
  if (override_name) {
    const Backend* b = find(*override_name);
    if (!b) {
      detail::fail(env_name.empty() ? "backend" : kBackendEnvVar, " '", *override_name,
                   "' is not a registered backend; valid backends: ", registered_names(backends_));
    }
    const auto reasons = b->check(query);
    if (!reasons.empty()) {
      detail::fail<NotSupported>("selected backend '", b->name(),
                                 "' is not valid for this configuration (", describe_query(query),
                                 "): ", join_reasons(reasons));
    }
    return *b;
  }
  for (const auto& b : backends_)
    if (b->check(query).empty()) return *b;
  detail::fail<NotSupported>("no attention backend supports this configuration (",
                             describe_query(query), "):\n", format_verdicts(explain(query)));
}

std::string format_verdicts(const std::vector<BackendVerdict>& verdicts) {
  size_t width = 7;
  for (const auto& v : verdicts) width = std::max(width, v.name.size());
  std::string s;
  for (const auto& v : verdicts) {
    std::string name = v.name;
    name.resize(width, ' ');
    if (v.supported()) {
      s += cat("  ", name, "  supported\n");
    } else {
      s += cat("  ", name, "  no: ", join_reasons(v.reasons), "\n");
    }
  }
  return s;
}

}  // namespace pagedattn
