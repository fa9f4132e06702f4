// The KVConnector base class, its configuration (spec strings, options, namespaces) and the
// registry of connector kinds.
#include "pagedattn/connector.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "connector/builtin_connectors.h"
#include "pagedattn/error.h"

namespace pagedattn {

using detail::cat;
using detail::fail;
using detail::require;

std::string_view to_string(KVConnectorRole role) {
  return role == KVConnectorRole::kScheduler ? "scheduler" : "worker";
}

std::string_view to_string(KVTransferRole role) {
  switch (role) {
    case KVTransferRole::kProducer:
      return "producer";
    case KVTransferRole::kConsumer:
      return "consumer";
    case KVTransferRole::kBoth:
      return "both";
  }
  return "?";
}

KVTransferRole parse_kv_transfer_role(std::string_view name) {
  if (name == "producer" || name == "prefill") return KVTransferRole::kProducer;
  if (name == "consumer" || name == "decode") return KVTransferRole::kConsumer;
  if (name == "both") return KVTransferRole::kBoth;
  fail("kv role '", name, "' is not producer (prefill), consumer (decode) or both");
}

KVConnectorStats& KVConnectorStats::operator+=(const KVConnectorStats& o) {
  lookups += o.lookups;
  lookup_blocks += o.lookup_blocks;
  hit_blocks += o.hit_blocks;
  miss_blocks += o.miss_blocks;
  lookup_errors += o.lookup_errors;
  save_scheduled += o.save_scheduled;
  save_not_held += o.save_not_held;
  loaded_blocks += o.loaded_blocks;
  rejected_blocks += o.rejected_blocks;
  missing_blocks += o.missing_blocks;
  unavailable_blocks += o.unavailable_blocks;
  saved_blocks += o.saved_blocks;
  save_errors += o.save_errors;
  save_dropped += o.save_dropped;
  loaded_bytes += o.loaded_bytes;
  saved_bytes += o.saved_bytes;
  load_seconds += o.load_seconds;
  save_seconds += o.save_seconds;
  return *this;
}

// ---------------------------------------------------------------------------------------------
// Configuration.

void KVConnectorConfig::validate() const {
  require(!name.empty(), "KV connector: name is empty (e.g. \"storage\" or \"redis\")");
  require(!model.empty(), "KV connector ", name, ": model is empty; it names the weights whose ",
          "KV the store holds");
  require(!layers.empty(), "KV connector ", name, ": layers is empty");
  require(block_size >= 1, "KV connector ", name, ": block_size (", block_size, ") must be >= 1");
  require(num_kv_heads >= 1, "KV connector ", name, ": num_kv_heads (", num_kv_heads,
          ") must be >= 1");
  require(head_size >= 1, "KV connector ", name, ": head_size (", head_size, ") must be >= 1");
  require(!is_fp8(kv_cache_dtype) || is_fp8(cache_dtype), "KV connector ", name,
          ": kv_cache_dtype ", to_string(kv_cache_dtype), " needs an fp8 cache_dtype; got ",
          dtype_name(cache_dtype));
  std::set<std::string_view> seen;
  for (size_t i = 0; i < layers.size(); ++i) {
    require(!layers[i].name.empty(), "KV connector ", name, ": layers[", i, "] has no name");
    require(layers[i].name.find_first_of(",\n") == std::string::npos, "KV connector ", name,
            ": layers[", i, "] name '", layers[i].name, "' contains a comma or newline");
    require(layers[i].kv_cache_group >= 0, "KV connector ", name, ": layers[", i,
            "].kv_cache_group (", layers[i].kv_cache_group, ") must be >= 0");
    require(seen.insert(layers[i].name).second, "KV connector ", name, ": layer name '",
            layers[i].name, "' appears twice");
  }
}

std::string KVConnectorConfig::namespace_name() const {
  std::string safe = model;
  bool changed = false;
  for (char& c : safe) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      c = '_';
      changed = true;
    }
  }
  if (safe.empty() || safe[0] == '.') {
    safe.insert(0, "m");
    changed = true;
  }
  if (changed) {
    // Different models must not meet in one namespace after the replacement.
    std::vector<int32_t> bytes(model.begin(), model.end());
    char buf[24];
    std::snprintf(buf, sizeof buf, "-%08llx",
                  static_cast<unsigned long long>(hash_block_tokens(kNoParentHash, bytes) >> 32));
    safe += buf;
  }
  return cat(safe, "/", to_string(kv_cache_dtype), "-", dtype_name(cache_dtype), "/L",
             layers.size(), "-H", num_kv_heads, "-D", head_size, "-B", block_size);
}

std::string KVConnectorConfig::option(std::string_view key, std::string_view fallback) const {
  const auto it = options.find(std::string(key));
  return it == options.end() ? std::string(fallback) : it->second;
}

int64_t KVConnectorConfig::int_option(std::string_view key, int64_t fallback, int64_t lo,
                                      int64_t hi) const {
  const auto it = options.find(std::string(key));
  if (it == options.end()) return fallback;
  const std::string& text = it->second;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  require(!text.empty() && end && *end == '\0' && errno == 0 && v >= lo && v <= hi, "KV connector ",
          name, ": option ", key, "='", text, "' must be an integer in [", lo, ", ", hi, "]");
  return v;
}

namespace {

// "k=v&k=v" into `options`.
void parse_options(std::string_view spec, std::string_view text,
                   std::map<std::string, std::string>& options) {
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t amp = text.find('&', pos);
    if (amp == std::string_view::npos) amp = text.size();
    const std::string_view item = text.substr(pos, amp - pos);
    const size_t eq = item.find('=');
    require(!item.empty() && eq != std::string_view::npos && eq > 0, "KV connector spec '",
            redact_kv_connector_spec(spec), "': option '", item, "' is not key=value");
    options[std::string(item.substr(0, eq))] = std::string(item.substr(eq + 1));
    pos = amp + 1;
  }
}

// "[[user]:password@]host[:port][/db]" of a redis:// URL.
void parse_redis_address(std::string_view spec, std::string_view rest, KVConnectorConfig& c) {
  const std::string shown = redact_kv_connector_spec(spec);
  const size_t at = rest.rfind('@');
  if (at != std::string_view::npos) {
    const std::string_view userinfo = rest.substr(0, at);
    const size_t colon = userinfo.find(':');
    if (colon == std::string_view::npos) {
      c.options["password"] = std::string(userinfo);
    } else {
      if (colon > 0) c.options["username"] = std::string(userinfo.substr(0, colon));
      c.options["password"] = std::string(userinfo.substr(colon + 1));
    }
    rest = rest.substr(at + 1);
  }
  const size_t slash = rest.find('/');
  if (slash != std::string_view::npos) {
    const std::string_view db = rest.substr(slash + 1);
    if (!db.empty()) c.options["db"] = std::string(db);
    rest = rest.substr(0, slash);
  }
  require(!rest.empty(), "KV connector spec '", shown, "': no host (e.g. redis://127.0.0.1:6379)");
  std::string host(rest), port = "6379";
  if (rest.front() == '[') {  // [::1]:6379
    const size_t close = rest.find(']');
    require(close != std::string_view::npos, "KV connector spec '", shown, "': unclosed '['");
    host = std::string(rest.substr(1, close - 1));
    if (close + 1 < rest.size()) {
      require(rest[close + 1] == ':', "KV connector spec '", shown, "': expected ':' after ']'");
      port = std::string(rest.substr(close + 2));
    }
  } else if (const size_t colon = rest.rfind(':'); colon != std::string_view::npos) {
    host = std::string(rest.substr(0, colon));
    port = std::string(rest.substr(colon + 1));
  }
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  require(!host.empty() && !port.empty() && end && *end == '\0' && p >= 1 && p <= 65535,
          "KV connector spec '", shown, "': port '", port, "' is not in [1, 65535]");
  c.address = cat(host, ":", p);
}

}  // namespace

KVConnectorConfig parse_kv_connector_spec(std::string_view spec) {
  const std::string shown = redact_kv_connector_spec(spec);
  const size_t colon = spec.find(':');
  require(colon != std::string_view::npos && colon > 0, "KV connector spec '", shown,
          "' has no kind; expected storage:/path or redis://host:port");
  KVConnectorConfig c;
  c.name = std::string(spec.substr(0, colon));
  std::string_view rest = spec.substr(colon + 1);
  const size_t question = rest.find('?');
  if (question != std::string_view::npos) {
    parse_options(spec, rest.substr(question + 1), c.options);
    rest = rest.substr(0, question);
  }
  if (c.name == "redis") {
    require(rest.substr(0, 2) == "//", "KV connector spec '", shown,
            "': expected redis://host:port");
    parse_redis_address(spec, rest.substr(2), c);
  } else {
    require(!rest.empty(), "KV connector spec '", shown, "': no address after '", c.name, ":'");
    c.address = std::string(rest);
  }
  return c;
}

std::string redact_kv_connector_spec(std::string_view spec) {
  std::string s(spec);
  const size_t scheme = s.find("://");
  if (scheme != std::string::npos) {
    const size_t start = scheme + 3;
    const size_t end = s.find_first_of("/?", start);
    const size_t at = s.rfind('@', end == std::string::npos ? s.size() : end);
    if (at != std::string::npos && at >= start) {
      const size_t colon = s.find(':', start);
      const size_t from = colon != std::string::npos && colon < at ? colon + 1 : start;
      s.replace(from, at - from, "***");
    }
  }
  for (size_t p = s.find("password="); p != std::string::npos; p = s.find("password=", p + 1)) {
    const size_t v = p + 9;
    const size_t e = s.find('&', v);
    s.replace(v, (e == std::string::npos ? s.size() : e) - v, "***");
  }
  return s;
}

namespace connector {

void check_known_options(const KVConnectorConfig& config,
                         std::initializer_list<std::string_view> known) {
  for (const auto& [key, value] : config.options) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string list;
    for (const std::string_view k : known) list += cat(list.empty() ? "" : ", ", k);
    fail(config.name, " connector: unknown option '", key, "' (known: ", list, ")");
  }
}

}  // namespace connector

// ---------------------------------------------------------------------------------------------
// The base class.

KVConnector::KVConnector(KVConnectorConfig config, KVConnectorRole role)
    : config_(std::move(config)), role_(role) {
  config_.validate();
}

KVConnector::~KVConnector() = default;

void KVConnector::bind_connector_metadata(std::shared_ptr<const KVConnectorMetadata> metadata) {
  require(role_ == KVConnectorRole::kWorker, "bind_connector_metadata: ", name(),
          " connector was built for the ", to_string(role_), " role");
  require(metadata != nullptr, "bind_connector_metadata: metadata is null");
  metadata_ = std::move(metadata);
}

void KVConnector::clear_connector_metadata() {
  metadata_.reset();
}

void KVConnector::register_kv_caches(const std::map<std::string, KVCacheView>&) {}

std::vector<int32_t> KVConnector::get_block_ids_with_load_errors() {
  return {};
}

void KVConnector::flush() {}

void KVConnector::update_connector_output(std::span<const int32_t>) {}

bool KVConnector::request_finished(const KVConnectorRequest&,
                                   std::span<const std::vector<int32_t>>) {
  return false;
}

// ---------------------------------------------------------------------------------------------
// Registry.

void KVConnectorRegistry::add(std::string name, KVConnectorFactory factory) {
  require(!name.empty(), "KVConnectorRegistry::add: the name is empty");
  require(factory != nullptr, "KVConnectorRegistry::add: connector '", name, "' has no factory");
  for (const auto& entry : factories_) {
    require(entry.first != name, "KVConnectorRegistry::add: connector '", name,
            "' is already registered");
  }
  factories_.emplace_back(std::move(name), std::move(factory));
}

std::vector<std::string> KVConnectorRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& entry : factories_) out.push_back(entry.first);
  return out;
}

std::unique_ptr<KVConnector> KVConnectorRegistry::create(const KVConnectorConfig& config,
                                                         KVConnectorRole role) const {
  for (const auto& [name, factory] : factories_) {
    if (name == config.name) {
      config.validate();
      return factory(config, role);
    }
  }
  std::string known;
  for (const auto& entry : factories_) known += cat(known.empty() ? "" : ", ", entry.first);
  fail("KV connector '", config.name, "' is not registered; known connectors: ", known);
}

KVConnectorRegistry& default_kv_connector_registry() {
  static KVConnectorRegistry registry = [] {
    KVConnectorRegistry r;
    r.add("storage", connector::make_storage_connector);
    r.add("redis", connector::make_redis_connector);
    return r;
  }();
  return registry;
}

std::unique_ptr<KVConnector> make_kv_connector(const KVConnectorConfig& config,
                                               KVConnectorRole role) {
  return default_kv_connector_registry().create(config, role);
}

}  // namespace pagedattn
