#include "sim/report.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace pagedattn::sim {

namespace {

std::string fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

std::string general(double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g", value);
  return buf;
}

// A length or rate as people write it: whole numbers from 1000 on (2048, not 2.05e+03), three
// significant digits below.
std::string plain(double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, std::fabs(value) >= 1000 ? "%.0f" : "%.3g", value);
  return buf;
}

double per_second(double amount, double seconds) {
  return seconds > 0 ? amount / seconds : 0.0;
}

double percent(double part, double whole) {
  return whole > 0 ? 100.0 * part / whole : 0.0;
}

std::string group_name(const GroupReport& g) {
  std::string s = g.kind;
  if (g.sliding_window) s += "(" + std::to_string(*g.sliding_window) + ")";
  return s;
}

}  // namespace

std::string format_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fixed(bytes, 0) + " B" : fixed(bytes, 1) + " " + kUnits[u];
}

std::string format_report(const SimReport& r) {
  std::ostringstream os;
  auto line = [&os](const char* key, const std::string& value) {
    char head[32];
    std::snprintf(head, sizeof head, "  %-18s", key);
    os << head << value << "\n";
  };
  os << "pagedattn run: " << r.preset << "\n";
  if (r.mla) {
    const MLAShape& m = *r.mla;
    line("model",
         std::to_string(r.num_layers) + " MLAAttention layers, " + std::to_string(r.num_heads) +
             " heads, kv_lora_rank " + std::to_string(m.kv_lora_rank) + " + qk_rope " +
             std::to_string(m.qk_rope_head_dim) + " (the backends attend over " +
             std::to_string(r.head_size) + "-wide latent entries, 1 kv head), qk_nope " +
             std::to_string(m.qk_nope_head_dim) + ", v_head " + std::to_string(m.v_head_dim) +
             (m.q_lora_rank ? ", q_lora_rank " + std::to_string(*m.q_lora_rank) : "") + ", " +
             r.dtype);
  } else {
    line("model", std::to_string(r.num_layers) + " layers, " + std::to_string(r.num_heads) +
                      " q heads / " + std::to_string(r.num_kv_heads) + " kv heads, head size " +
                      std::to_string(r.head_size) + ", " + r.dtype);
  }
  if (r.mla) {
    line("mla formulation",
         r.mla_formulation +
             (r.mla_formulation == "split"
                  ? " (vLLM's: decodes absorbed, prefills with K/V expanded per head)"
                  : " for every request") +
             ", cached context expanded " + std::to_string(r.mla_context_chunk_tokens) +
             " latent entries at a time");
  }
  if (r.model_num_layers > 0 || r.model_num_heads > 0) {
    line("scaled down", std::to_string(r.num_layers) + " of the model's " +
                            std::to_string(r.model_num_layers) + " layers, " +
                            std::to_string(r.num_heads) + " of its " +
                            std::to_string(r.model_num_heads) + " heads: " + r.scaled_down_reason);
  }
  std::string backends;
  for (const auto& [name, count] : r.backends) {
    backends += (backends.empty() ? "" : ", ") + name + " (" + std::to_string(count) + " layers)";
  }
  line("backend", backends + " on " + r.device);
  std::string groups;
  for (const GroupReport& g : r.groups) {
    groups += (groups.empty() ? "" : " + ") + group_name(g) + " x" + std::to_string(g.num_layers);
  }
  line("kv cache", r.kv_cache_dtype + " (" + r.kv_cache_storage_dtype + "), " + r.kv_cache_layout +
                       ", " + std::to_string(r.groups.size()) +
                       (r.groups.size() == 1 ? " group: " : " groups: ") + groups);
  line("kv blocks",
       std::to_string(r.num_blocks) + " of " + std::to_string(r.block_size) + " tokens (" +
           std::to_string(r.usable_blocks) + " usable, block 0 is the null block), " +
           format_bytes(double(r.kv_cache_bytes)) + " for a budget of " +
           format_bytes(double(r.kv_cache_budget)) + (r.kv_cache_budget_auto ? " (auto)" : ""));
  if (r.k_scale) {
    line("fp8 scales", "k_scale " + general(*r.k_scale) +
                           (r.v_scale ? ", v_scale " + general(*r.v_scale) : std::string()) +
                           " (calibrated)");
  }
  line("scheduler", "max_num_batched_tokens " + std::to_string(r.max_num_batched_tokens) +
                        ", max_num_seqs " + std::to_string(r.max_num_seqs) + ", max_model_len " +
                        std::to_string(r.max_model_len) + ", prefix caching " +
                        (r.prefix_caching ? "on" : "off"));
  const WorkloadOptions& w = r.workload;
  line("workload", std::to_string(r.num_requests) + " requests (seed " + std::to_string(w.seed) +
                       "), " + std::to_string(r.workload_prompt_tokens) + " prompt + " +
                       std::to_string(r.workload_output_tokens) +
                       " output tokens; medians prompt " + plain(w.prompt_len_median) +
                       ", output " + plain(w.output_len_median) + "; " +
                       fixed(100 * w.shared_prefix_fraction, 0) + "% share " +
                       std::to_string(w.num_shared_prefixes) + " system prompts; " +
                       (w.arrival_rate > 0 ? plain(w.arrival_rate) + " arrivals/step"
                                           : std::string("all arrive at once")));
  line("requests", std::to_string(r.finished_requests) + " of " + std::to_string(r.num_requests) +
                       " finished in " + std::to_string(r.steps) + " steps (" +
                       std::to_string(r.mixed_steps) + " mixed prefill+decode)");
  line("tokens", "prefill " + std::to_string(r.prefill_tokens) + ", decode " +
                     std::to_string(r.decode_tokens) + "; " +
                     std::to_string(r.partial_prefill_chunks) + " partial prefill chunks");
  line("attention time",
       fixed(r.attention_seconds, 3) + " s (" +
           fixed(1e3 * per_second(r.attention_seconds, double(std::max<int64_t>(r.steps, 1))), 2) +
           " ms/step" +
           (r.mla ? std::string(", MLAAttention.forward: its host projections included") : "") +
           "); wall " + fixed(r.wall_seconds, 2) + " s, of which verification " +
           fixed(r.verify_seconds, 2) + " s");
  const double read_rate = per_second(r.kv_bytes_read, r.attention_seconds);
  std::string kv = format_bytes(r.kv_bytes_read) + " read, " + fixed(read_rate / 1e9, 2) + " GB/s";
  if (r.machine_read_bandwidth) {
    kv += " = " + fixed(percent(read_rate, *r.machine_read_bandwidth), 1) + "% of the machine's " +
          fixed(*r.machine_read_bandwidth / 1e9, 2) + " GB/s (" + r.bandwidth_method + ")";
  }
  line("kv read", kv);
  line("attention flops", general(r.attention_flops) + ", " +
                              fixed(per_second(r.attention_flops, r.attention_seconds) / 1e9, 2) +
                              " GFLOP/s");
  line("cache use",
       "peak " + std::to_string(r.peak_blocks_used) + " / " + std::to_string(r.usable_blocks) +
           " blocks (" + fixed(percent(double(r.peak_blocks_used), double(r.usable_blocks)), 1) +
           "%); " + std::to_string(r.window_blocks_released) + " blocks left a window; " +
           std::to_string(r.evictions) + " cached blocks evicted");
  line("prefix cache", std::to_string(r.prefix_hit_tokens) + " of " +
                           std::to_string(r.lookup_tokens) + " prompt tokens hit (" +
                           fixed(percent(double(r.prefix_hit_tokens), double(r.lookup_tokens)), 1) +
                           "%)");
  line("preemptions", std::to_string(r.preemptions));
  if (!r.kv_connector.empty()) {
    const KVConnectorStats& c = r.connector;
    auto n = [](int64_t v) { return std::to_string(v); };
    line("kv connector", r.kv_connector + " (role " + r.role + ")");
    line("kv lookups", n(c.lookup_blocks) + " blocks asked in " + n(c.lookups) + " lookups: " +
                           n(c.hit_blocks) + " hit, " + n(c.miss_blocks) + " miss (" +
                           n(c.lookup_errors) + " lookups could not reach the store); " +
                           n(r.external_hit_tokens) + " prompt tokens loaded, not computed");
    line("kv loads", n(c.loaded_blocks) + " blocks loaded (" +
                         format_bytes(double(c.loaded_bytes)) + "), " + n(c.rejected_blocks) +
                         " rejected (torn, truncated or mismatched), " + n(c.missing_blocks) +
                         " gone, " + n(c.unavailable_blocks) + " unreachable; " +
                         n(r.load_error_requests) + " request steps redone (" +
                         n(r.load_error_tokens) + " tokens)");
    line("kv saves", n(c.saved_blocks) + " blocks saved (" + format_bytes(double(c.saved_bytes)) +
                         ") of " + n(c.save_scheduled) + " scheduled, " + n(c.save_errors) +
                         " failed, " + n(c.save_dropped) + " dropped, " + n(c.save_not_held) +
                         " not held");
  }
  if (!r.digest_file.empty()) {
    line("digest", std::to_string(r.digest_rows) + " rows in " + r.digest_file);
  }
  std::string v;
  if (r.verify_every == 0) {
    v = "off";
  } else {
    v = std::to_string(r.verified_steps) + " steps (every " + std::to_string(r.verify_every) +
        "), " + std::to_string(r.layer_checks) + " layer checks, " +
        (r.failed_checks == 0 ? std::string("all passed")
                              : std::to_string(r.failed_checks) + " FAILED");
    if (r.worst.step >= 0) {
      v += "; worst max|err| " + general(r.worst.max_abs) + " vs budget " +
           general(r.worst.budget) + " (step " + std::to_string(r.worst.step) + ", " +
           r.worst.layer + ")";
    }
    if (r.deferred_checks > 0) {
      v += "; " + std::to_string(r.deferred_checks) +
           " due steps deferred (too large for the float64 reference)";
    }
  }
  line("verification", v);
  for (const std::string& f : r.failure_files) line("failing case", f);
  // Last, where a reader of the run's tail sees it.
  const ConnectorShortfall shortfall = connector_shortfall(r);
  if (!shortfall.message.empty()) {
    line(shortfall.failed ? "kv FAILED" : "kv warning", shortfall.message);
  }
  return os.str();
}

ConnectorShortfall connector_shortfall(const SimReport& r) {
  ConnectorShortfall s;
  if (r.kv_connector.empty()) return s;
  const KVConnectorStats& c = r.connector;
  if (r.role != "consumer" && c.save_scheduled > 0 && c.saved_blocks == 0) {
    s.failed = true;
    s.message = "none of the " + std::to_string(c.save_scheduled) + " blocks scheduled to save " +
                "was saved (" + std::to_string(c.save_errors) + " failed, " +
                std::to_string(c.save_dropped) + " dropped)";
  } else if (r.role == "consumer" && c.lookup_blocks > 0 && c.hit_blocks == 0) {
    s.message = "nothing was loaded: the store held none of the " +
                std::to_string(c.lookup_blocks) + " blocks asked about" +
                (c.lookup_errors > 0
                     ? " (" + std::to_string(c.lookup_errors) + " lookups could not reach it)"
                     : std::string(" (is it the store a prefill run wrote?)"));
  }
  return s;
}

std::string report_json(const SimReport& r) {
  using nlohmann::json;
  json groups = json::array();
  for (const GroupReport& g : r.groups) {
    groups.push_back({{"kind", g.kind},
                      {"sliding_window", g.sliding_window ? json(*g.sliding_window) : json()},
                      {"num_layers", g.num_layers}});
  }
  json backends = json::object();
  for (const auto& [name, count] : r.backends) backends[name] = count;
  const WorkloadOptions& w = r.workload;
  json j;
  j["preset"] = r.preset;
  j["model"] = {{"layer", r.layer_kind},    {"num_layers", r.num_layers},
                {"num_heads", r.num_heads}, {"num_kv_heads", r.num_kv_heads},
                {"head_size", r.head_size}, {"dtype", r.dtype}};
  if (r.mla) {
    const MLAShape& m = *r.mla;
    j["model"]["mla"] = {{"qk_nope_head_dim", m.qk_nope_head_dim},
                         {"qk_rope_head_dim", m.qk_rope_head_dim},
                         {"v_head_dim", m.v_head_dim},
                         {"kv_lora_rank", m.kv_lora_rank},
                         {"q_lora_rank", m.q_lora_rank ? json(*m.q_lora_rank) : json()},
                         {"formulation", r.mla_formulation},
                         {"context_chunk_tokens", r.mla_context_chunk_tokens}};
  }
  if (r.model_num_layers > 0 || r.model_num_heads > 0) {
    j["model"]["scaled_down"] = {{"model_num_layers", r.model_num_layers},
                                 {"model_num_heads", r.model_num_heads},
                                 {"reason", r.scaled_down_reason}};
  }
  j["backends"] = backends;
  j["device"] = r.device;
  j["kv_cache"] = {{"dtype", r.kv_cache_dtype},
                   {"storage_dtype", r.kv_cache_storage_dtype},
                   {"layout", r.kv_cache_layout},
                   {"block_size", r.block_size},
                   {"groups", groups},
                   {"num_blocks", r.num_blocks},
                   {"usable_blocks", r.usable_blocks},
                   {"bytes", r.kv_cache_bytes},
                   {"budget_bytes", r.kv_cache_budget},
                   {"budget_auto", r.kv_cache_budget_auto},
                   {"k_scale", r.k_scale ? json(*r.k_scale) : json()},
                   {"v_scale", r.v_scale ? json(*r.v_scale) : json()}};
  j["scheduler"] = {{"max_num_batched_tokens", r.max_num_batched_tokens},
                    {"max_num_seqs", r.max_num_seqs},
                    {"max_model_len", r.max_model_len},
                    {"prefix_caching", r.prefix_caching}};
  j["workload"] = {{"seed", w.seed},
                   {"num_requests", r.num_requests},
                   {"prompt_len_median", w.prompt_len_median},
                   {"output_len_median", w.output_len_median},
                   {"shared_prefix_fraction", w.shared_prefix_fraction},
                   {"num_shared_prefixes", w.num_shared_prefixes},
                   {"arrival_rate", w.arrival_rate},
                   {"prompt_tokens", r.workload_prompt_tokens},
                   {"output_tokens", r.workload_output_tokens}};
  j["run"] = {{"finished_requests", r.finished_requests},
              {"steps", r.steps},
              {"mixed_steps", r.mixed_steps},
              {"prefill_tokens", r.prefill_tokens},
              {"decode_tokens", r.decode_tokens},
              {"partial_prefill_chunks", r.partial_prefill_chunks},
              {"preemptions", r.preemptions},
              {"attention_seconds", r.attention_seconds},
              {"wall_seconds", r.wall_seconds},
              {"kv_bytes_read", r.kv_bytes_read},
              {"kv_read_bytes_per_second", per_second(r.kv_bytes_read, r.attention_seconds)},
              {"machine_read_bytes_per_second",
               r.machine_read_bandwidth ? json(*r.machine_read_bandwidth) : json()},
              {"bandwidth_method", r.bandwidth_method},
              {"attention_flops", r.attention_flops},
              {"attention_flops_per_second", per_second(r.attention_flops, r.attention_seconds)}};
  j["cache_use"] = {{"peak_blocks_used", r.peak_blocks_used},
                    {"usable_blocks", r.usable_blocks},
                    {"window_blocks_released", r.window_blocks_released},
                    {"evictions", r.evictions}};
  j["prefix_cache"] = {
      {"hit_tokens", r.prefix_hit_tokens},
      {"lookup_tokens", r.lookup_tokens},
      {"hit_rate",
       r.lookup_tokens > 0 ? double(r.prefix_hit_tokens) / double(r.lookup_tokens) : 0.0}};
  if (!r.kv_connector.empty()) {
    const KVConnectorStats& c = r.connector;
    j["kv_connector"] = {{"spec", r.kv_connector},
                         {"role", r.role},
                         {"lookups", c.lookups},
                         {"lookup_blocks", c.lookup_blocks},
                         {"hit_blocks", c.hit_blocks},
                         {"miss_blocks", c.miss_blocks},
                         {"lookup_errors", c.lookup_errors},
                         {"external_hit_tokens", r.external_hit_tokens},
                         {"loaded_blocks", c.loaded_blocks},
                         {"loaded_bytes", c.loaded_bytes},
                         {"rejected_blocks", c.rejected_blocks},
                         {"missing_blocks", c.missing_blocks},
                         {"unavailable_blocks", c.unavailable_blocks},
                         {"load_error_requests", r.load_error_requests},
                         {"load_error_tokens", r.load_error_tokens},
                         {"save_scheduled", c.save_scheduled},
                         {"saved_blocks", c.saved_blocks},
                         {"saved_bytes", c.saved_bytes},
                         {"save_errors", c.save_errors},
                         {"save_dropped", c.save_dropped},
                         {"save_not_held", c.save_not_held},
                         {"load_seconds", c.load_seconds},
                         {"save_seconds", c.save_seconds}};
  }
  if (!r.digest_file.empty()) {
    j["digest"] = {{"file", r.digest_file}, {"rows", r.digest_rows}};
  }
  json worst;
  if (r.worst.step >= 0) {
    worst = {{"step", r.worst.step},
             {"layer", r.worst.layer},
             {"max_abs", r.worst.max_abs},
             {"budget", r.worst.budget}};
  }
  j["verification"] = {{"every", r.verify_every},
                       {"verified_steps", r.verified_steps},
                       {"layer_checks", r.layer_checks},
                       {"failed_checks", r.failed_checks},
                       {"deferred_steps", r.deferred_checks},
                       {"seconds", r.verify_seconds},
                       {"worst", worst},
                       {"failure_files", r.failure_files},
                       {"passed", r.passed()}};
  return j.dump(2) + "\n";
}

}  // namespace pagedattn::sim
