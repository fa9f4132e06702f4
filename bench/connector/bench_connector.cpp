// bench_connector: save and load throughput of the KV connectors (GB/s of K/V moved between the
// paged caches and the store) next to the raw speed of the same store measured in the same run:
// for "storage", the same files written (write, fsync, rename) and read back by plain POSIX
// calls; for "redis", the same values SET and GET over one pipelined hiredis connection. Loads
// are timed cold (the entries' pages dropped from the page cache with posix_fadvise, so they
// come from the disk) and warm. The transfers go through the public API exactly as an engine's
// do: the scheduler-side connector plans the step, the ForwardContext starts the loads, each
// layer waits for its load and saves after its "attention", end_step waits for the saves.
//
//   bench_connector [--connector storage|redis|both] [--dir DIR] [--redis URL] [--blocks N]
//                   [--layers L] [--kv-heads H] [--head-size D] [--block-size B] [--repeats R]
//                   [--io-threads T] [--json]
//
// Without --redis, a redis-server of its own is started on a free loopback port (when
// installed). docs/connector.md records the figures.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pagedattn/connector.h"
#include "pagedattn/error.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"

#if PAGEDATTN_WITH_REDIS
#include <hiredis/hiredis.h>
#endif

namespace {

using namespace pagedattn;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Options {
  std::string connector = "both";
  std::string dir;
  std::string redis;
  int blocks = 128;
  int layers = 32;
  int kv_heads = 8;
  int head_size = 128;
  int block_size = 16;
  int repeats = 3;
  int io_threads = 2;
  bool json = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "bench_connector: %s (see the top of bench/connector/bench_connector.cpp)\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    auto number = [&]() {
      const std::string v = value();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (!end || *end || n < 1 || n > 1 << 20)
        usage((a + " " + v + " is not in [1, 2^20]").c_str());
      return int(n);
    };
    if (a == "--connector")
      o.connector = value();
    else if (a == "--dir")
      o.dir = value();
    else if (a == "--redis")
      o.redis = value();
    else if (a == "--blocks")
      o.blocks = number();
    else if (a == "--layers")
      o.layers = number();
    else if (a == "--kv-heads")
      o.kv_heads = number();
    else if (a == "--head-size")
      o.head_size = number();
    else if (a == "--block-size")
      o.block_size = number();
    else if (a == "--repeats")
      o.repeats = number();
    else if (a == "--io-threads")
      o.io_threads = number();
    else if (a == "--json")
      o.json = true;
    else
      usage(("unknown argument " + a).c_str());
  }
  if (o.connector != "storage" && o.connector != "redis" && o.connector != "both") {
    usage("--connector must be storage, redis or both");
  }
  return o;
}

// Layers in a context with caches of blocks + 1 blocks (block 0 is the null block).
class Model {
 public:
  explicit Model(const Options& o) : o_(o) {
    for (int i = 0; i < o.layers; ++i) {
      AttentionOptions a;
      a.num_heads = o.kv_heads;
      a.num_kv_heads = o.kv_heads;
      a.head_size = o.head_size;
      a.scale = 0.1f;
      a.prefix = "model.layers." + std::to_string(i) + ".self_attn.attn";
      a.attn_backend = "ref";
      a.cache_config = CacheConfig{};
      a.cache_config->block_size = o.block_size;
      layers_.push_back(std::make_unique<Attention>(ctx_, a));
      caches_.push_back(KVCache::allocate(layers_.back()->config(), o.blocks + 1));
      layers_.back()->bind_kv_cache({caches_.back().view()});
      std::mt19937 rng(static_cast<uint32_t>(i));
      auto* p = static_cast<uint32_t*>(caches_.back().storage().data());
      for (size_t k = 0; k < caches_.back().storage().view().nbytes() / 4; ++k) p[k] = rng();
    }
  }
  KVConnectorConfig config(const std::string& spec) const {
    KVConnectorConfig c = parse_kv_connector_spec(spec);
    c.model = "bench";
    for (const auto& l : layers_) c.layers.push_back({l->name(), 0});
    c.block_size = o_.block_size;
    c.num_kv_heads = o_.kv_heads;
    c.head_size = o_.head_size;
    c.cache_dtype = DType::kBF16;
    return c;
  }
  ForwardContext& context() { return ctx_; }
  Attention& layer(size_t i) { return *layers_[i]; }
  size_t num_layers() const { return layers_.size(); }
  // Bytes of one stored block (every layer).
  int64_t entry_data_bytes() const {
    return int64_t(o_.layers) * 2 * o_.block_size * o_.kv_heads * o_.head_size * 2;
  }

 private:
  Options o_;
  ForwardContext ctx_;
  std::vector<std::unique_ptr<Attention>> layers_;
  std::vector<KVCache> caches_;
};

// One step of transfers through the public hooks; returns seconds until the last layer's load
// was waited for (loads) or until wait_for_save returned (saves).
double run_step(Model& m, KVConnector& worker, std::shared_ptr<const KVConnectorMetadata> meta) {
  ForwardContext& ctx = m.context();
  ctx.set_kv_connector(&worker);
  worker.bind_connector_metadata(std::move(meta));
  StepMetadata step = MetadataBuilder(16).add({0, 1, {1}}).build();
  AttentionMetadata md = step.view();
  const auto t0 = Clock::now();
  ctx.begin_step({&md});
  for (size_t i = 0; i < m.num_layers(); ++i) {
    KVConnector* c = ctx.active_kv_connector();
    c->wait_for_layer_load(m.layer(i).name());
    c->save_kv_layer(m.layer(i).name(), m.layer(i).kv_cache(), md, m.layer(i).kv_scales());
  }
  ctx.end_step();
  const double seconds = seconds_since(t0);
  worker.get_block_ids_with_load_errors();
  worker.clear_connector_metadata();
  ctx.set_kv_connector(nullptr);
  return seconds;
}

struct Result {
  std::string store;
  double save_gbs = 0, save_blocking_gbs = 0, load_cold_gbs = 0, load_warm_gbs = 0;
  double raw_write_gbs = 0, raw_read_cold_gbs = 0, raw_read_warm_gbs = 0;
  int64_t bytes = 0;
};

std::vector<int32_t> prompt_of(int blocks, int block_size, int salt) {
  std::vector<int32_t> t(size_t(blocks * block_size + 1));
  for (size_t i = 0; i < t.size(); ++i) t[i] = int32_t(salt * 1'000'003 + int(i));
  return t;
}

// Saves then loads `blocks` blocks through `spec`, `repeats` times; best of each.
void bench_connector(const Options& o, Model& m, const std::string& spec, Result& r,
                     const std::function<void()>& drop_caches) {
  const KVConnectorConfig config = m.config(spec);
  const double bytes = double(m.entry_data_bytes()) * o.blocks;
  std::vector<std::vector<int32_t>> table = {{}};
  for (int b = 1; b <= o.blocks; ++b) table[0].push_back(b);
  for (int rep = 0; rep < o.repeats; ++rep) {
    const std::vector<int32_t> prompt = prompt_of(o.blocks, o.block_size, rep + 1);
    KVConnectorRequest req;
    req.request_id = rep;
    req.token_ids = prompt;
    req.num_prompt_tokens = int(prompt.size());
    {  // Save: a producer's scheduler plans it, the worker does it; flush() ends the clock.
      KVConnectorConfig c = config;
      c.kv_role = KVTransferRole::kProducer;
      auto sched = make_kv_connector(c, KVConnectorRole::kScheduler);
      auto worker = make_kv_connector(c, KVConnectorRole::kWorker);
      sched->get_num_new_matched_tokens(req, 0);
      sched->update_state_after_alloc(req, table, 0);
      KVConnectorSchedulerOutput out;
      out.requests.push_back({req, table, 0, int(prompt.size())});
      auto meta = sched->build_connector_meta(out);
      const auto t0 = Clock::now();
      const double blocking = run_step(m, *worker, meta);
      worker->flush();
      const double total = seconds_since(t0);
      const KVConnectorStats st = worker->stats();
      if (st.saved_blocks != o.blocks) {
        std::fprintf(stderr, "bench_connector: %s saved %lld of %d blocks\n", spec.c_str(),
                     static_cast<long long>(st.saved_blocks), o.blocks);
        std::exit(1);
      }
      r.save_gbs = std::max(r.save_gbs, bytes / total / 1e9);
      r.save_blocking_gbs = std::max(r.save_blocking_gbs, bytes / blocking / 1e9);
    }
    for (const bool cold : {true, false}) {  // Load: a consumer's scheduler finds them all.
      if (cold) drop_caches();
      KVConnectorConfig c = config;
      c.kv_role = KVTransferRole::kConsumer;
      auto sched = make_kv_connector(c, KVConnectorRole::kScheduler);
      auto worker = make_kv_connector(c, KVConnectorRole::kWorker);
      const int found = sched->get_num_new_matched_tokens(req, 0).num_tokens.value_or(0);
      if (found != o.blocks * o.block_size) {
        std::fprintf(stderr, "bench_connector: %s found %d of %d tokens\n", spec.c_str(), found,
                     o.blocks * o.block_size);
        std::exit(1);
      }
      sched->update_state_after_alloc(req, table, found);
      KVConnectorSchedulerOutput out;
      out.requests.push_back({req, table, found, 1});
      const double seconds = run_step(m, *worker, sched->build_connector_meta(out));
      if (worker->stats().loaded_blocks != o.blocks) {
        std::fprintf(stderr, "bench_connector: %s loaded %lld of %d blocks\n", spec.c_str(),
                     static_cast<long long>(worker->stats().loaded_blocks), o.blocks);
        std::exit(1);
      }
      double& best = cold ? r.load_cold_gbs : r.load_warm_gbs;
      best = std::max(best, bytes / seconds / 1e9);
    }
  }
  r.bytes = int64_t(bytes);
}

// --- the raw disk: the same files, written and read by plain POSIX calls ------------------------

void raw_disk(const Options& o, const std::string& dir, int64_t entry_bytes, Result& r) {
  std::vector<char> data(static_cast<size_t>(entry_bytes));
  std::mt19937 rng(5);
  for (char& ch : data) ch = char(rng());
  const double bytes = double(entry_bytes) * o.blocks;
  for (int rep = 0; rep < o.repeats; ++rep) {
    const std::string folder = dir + "/raw" + std::to_string(rep);
    std::filesystem::create_directories(folder);
    auto path = [&](int b) { return folder + "/" + std::to_string(b); };
    auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (int t = 0; t < o.io_threads; ++t) {
      threads.emplace_back([&, t] {
        for (int b = t; b < o.blocks; b += o.io_threads) {
          const std::string tmp = path(b) + ".tmp";
          const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
          if (fd < 0 || ::write(fd, data.data(), data.size()) != ssize_t(data.size()) ||
              ::fsync(fd) != 0 || ::close(fd) != 0 || ::rename(tmp.c_str(), path(b).c_str())) {
            std::perror("bench_connector: raw write");
            std::exit(1);
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    r.raw_write_gbs = std::max(r.raw_write_gbs, bytes / seconds_since(t0) / 1e9);
    for (const bool cold : {true, false}) {
      if (cold) {
        for (int b = 0; b < o.blocks; ++b) {
          const int fd = ::open(path(b).c_str(), O_RDONLY);
          ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
          ::close(fd);
        }
      }
      t0 = Clock::now();
      std::vector<char> in(data.size());
      for (int b = 0; b < o.blocks; ++b) {
        const int fd = ::open(path(b).c_str(), O_RDONLY);
        if (fd < 0 || ::read(fd, in.data(), in.size()) != ssize_t(in.size())) {
          std::perror("bench_connector: raw read");
          std::exit(1);
        }
        ::close(fd);
      }
      double& best = cold ? r.raw_read_cold_gbs : r.raw_read_warm_gbs;
      best = std::max(best, bytes / seconds_since(t0) / 1e9);
    }
    std::filesystem::remove_all(folder);
  }
}

void drop_dir_caches(const std::string& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd >= 0) {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
}

#if PAGEDATTN_WITH_REDIS

// A redis-server of the bench's own on a free loopback port.
class OwnRedis {
 public:
  explicit OwnRedis(const std::string& dir) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    port_ = ntohs(a.sin_port);
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string port = std::to_string(port_), log = dir + "/redis.log";
      ::execlp("redis-server", "redis-server", "--port", port.c_str(), "--bind", "127.0.0.1",
               "--dir", dir.c_str(), "--save", "", "--appendonly", "no", "--logfile", log.c_str(),
               static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      timeval tv{0, 100000};
      redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
      const bool up = c && !c->err;
      if (c) redisFree(c);
      if (up) return;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    pid_ = -1;
  }
  ~OwnRedis() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  bool up() const { return pid_ > 0; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

 private:
  int port_ = 0;
  pid_t pid_ = -1;
};

// The same values SET and GET over one pipelined connection.
void raw_redis(const Options& o, const std::string& host, int port, int64_t entry_bytes,
               Result& r) {
  timeval tv{10, 0};
  redisContext* c = redisConnectWithTimeout(host.c_str(), port, tv);
  if (!c || c->err) {
    std::fprintf(stderr, "bench_connector: cannot reach redis at %s:%d\n", host.c_str(), port);
    std::exit(1);
  }
  if (const char* pw = std::getenv("PAGEDATTN_REDIS_PASSWORD")) {
    freeReplyObject(redisCommand(c, "AUTH %s", pw));
  }
  std::vector<char> data(static_cast<size_t>(entry_bytes));
  std::mt19937 rng(6);
  for (char& ch : data) ch = char(rng());
  const double bytes = double(entry_bytes) * o.blocks;
  auto key = [](int b) { return "bench:raw:" + std::to_string(b); };
  for (int rep = 0; rep < o.repeats; ++rep) {
    auto t0 = Clock::now();
    for (int b = 0; b < o.blocks; ++b) {
      const std::string k = key(b);
      redisAppendCommand(c, "SET %b %b", k.data(), k.size(), data.data(), data.size());
    }
    for (int b = 0; b < o.blocks; ++b) {
      void* reply = nullptr;
      redisGetReply(c, &reply);
      freeReplyObject(reply);
    }
    r.raw_write_gbs = std::max(r.raw_write_gbs, bytes / seconds_since(t0) / 1e9);
    t0 = Clock::now();
    for (int b = 0; b < o.blocks; ++b) {
      const std::string k = key(b);
      redisAppendCommand(c, "GET %b", k.data(), k.size());
    }
    for (int b = 0; b < o.blocks; ++b) {
      void* reply = nullptr;
      redisGetReply(c, &reply);
      freeReplyObject(reply);
    }
    r.raw_read_warm_gbs = std::max(r.raw_read_warm_gbs, bytes / seconds_since(t0) / 1e9);
  }
  for (int b = 0; b < o.blocks; ++b) freeReplyObject(redisCommand(c, "DEL %s", key(b).c_str()));
  redisFree(c);
}

#endif  // PAGEDATTN_WITH_REDIS

void print(const Options& o, const std::vector<Result>& results, int64_t entry_bytes) {
  if (o.json) {
    std::printf(
        "{\n  \"layers\": %d, \"kv_heads\": %d, \"head_size\": %d, \"block_size\": %d,\n"
        "  \"blocks\": %d, \"entry_bytes\": %lld, \"io_threads\": %d,\n  \"results\": [",
        o.layers, o.kv_heads, o.head_size, o.block_size, o.blocks,
        static_cast<long long>(entry_bytes), o.io_threads);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf(
          "%s\n    {\"store\": \"%s\", \"save_gbs\": %.3f, \"save_blocking_gbs\": %.3f, "
          "\"load_cold_gbs\": %.3f, \"load_warm_gbs\": %.3f, \"raw_write_gbs\": %.3f, "
          "\"raw_read_cold_gbs\": %.3f, \"raw_read_warm_gbs\": %.3f}",
          i ? "," : "", r.store.c_str(), r.save_gbs, r.save_blocking_gbs, r.load_cold_gbs,
          r.load_warm_gbs, r.raw_write_gbs, r.raw_read_cold_gbs, r.raw_read_warm_gbs);
    }
    std::printf("\n  ]\n}\n");
    return;
  }
  std::printf(
      "bench_connector: %d blocks of %d tokens x %d layers (%d KV heads, head size %d, "
      "bf16): %.2f MiB per block, %.1f MiB per run; best of %d; %d writer threads\n",
      o.blocks, o.block_size, o.layers, o.kv_heads, o.head_size, double(entry_bytes) / 1048576.0,
      double(entry_bytes) * o.blocks / 1048576.0, o.repeats, o.io_threads);
  std::printf("  %-8s %8s %9s %9s %9s | %9s %9s %9s   (GB/s)\n", "store", "save", "save-blk",
              "load-cold", "load-warm", "raw-write", "raw-cold", "raw-warm");
  for (const Result& r : results) {
    std::printf("  %-8s %8.2f %9.2f %9.2f %9.2f | %9.2f %9.2f %9.2f\n", r.store.c_str(), r.save_gbs,
                r.save_blocking_gbs, r.load_cold_gbs, r.load_warm_gbs, r.raw_write_gbs,
                r.raw_read_cold_gbs, r.raw_read_warm_gbs);
  }
  std::printf(
      "  save: until every entry is in the store; save-blk: until wait_for_save returns "
      "(what the step waits for);\n  load: until the last layer's load is waited for; "
      "raw: the same bytes through the store without the connector\n");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    Model model(o);
    const int64_t entry_bytes = model.entry_data_bytes();
    std::vector<Result> results;
    std::string base = o.dir;
    std::optional<std::string> own_dir;
    if (base.empty()) {
      std::string pattern = (std::filesystem::temp_directory_path() / "pagedattn-bench-XXXXXX");
      if (!::mkdtemp(pattern.data())) {
        std::perror("bench_connector: mkdtemp");
        return 1;
      }
      base = pattern;
      own_dir = base;
    }
    if (o.connector != "redis") {
      Result r;
      r.store = "storage";
      const std::string store = base + "/store";
      bench_connector(o, model, "storage:" + store + "?io_threads=" + std::to_string(o.io_threads),
                      r, [&] { drop_dir_caches(store); });
      raw_disk(o, base, entry_bytes, r);
      results.push_back(r);
    }
    if (o.connector != "storage") {
#if PAGEDATTN_WITH_REDIS
      std::unique_ptr<OwnRedis> own;
      std::string url = o.redis;
      if (url.empty()) {
        own = std::make_unique<OwnRedis>(base);
        if (!own->up()) {
          std::fprintf(stderr, "bench_connector: redis-server did not start (is it installed?)\n");
          return 1;
        }
        url = own->url();
      }
      Result r;
      r.store = "redis";
      bench_connector(o, model, url + "?io_threads=" + std::to_string(o.io_threads), r, [] {});
      const KVConnectorConfig parsed = parse_kv_connector_spec(url);
      const size_t colon = parsed.address.rfind(':');
      raw_redis(o, parsed.address.substr(0, colon), std::atoi(parsed.address.c_str() + colon + 1),
                entry_bytes, r);
      r.load_cold_gbs = r.load_warm_gbs;  // Redis keeps its values in memory
      r.raw_read_cold_gbs = r.raw_read_warm_gbs;
      results.push_back(r);
#else
      std::fprintf(stderr, "bench_connector: built without the Redis connector\n");
      return 1;
#endif
    }
    if (own_dir) std::filesystem::remove_all(*own_dir);
    print(o, results, entry_bytes);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_connector: %s\n", e.what());
    return 1;
  }
  return 0;
}
