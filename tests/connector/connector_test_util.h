// Helpers of the connector tests: a small model (layers in a ForwardContext with bound caches),
// the connector config for it, cache-block fills and comparisons, per-test temporary
// directories, and a redis-server of the test's own on a free loopback port.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "connector/block_copy.h"
#include "connector/block_store_connector.h"
#include "pagedattn/connector.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"

#if PAGEDATTN_WITH_REDIS
#include <hiredis/hiredis.h>
#endif

namespace pagedattn::testing {

/// A fresh directory under $TMPDIR, removed with the object.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pagedattn-conn-XXXXXX");
    char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Model shape of the tests: 4 query heads, 2 KV heads, head size 8, blocks of 4 tokens.
struct ModelShape {
  int num_layers = 3;
  int num_kv_heads = 2;
  int head_size = 8;
  int block_size = 4;
  int64_t num_blocks = 32;
  KVCacheLayout layout = KVCacheLayout::kNHD;
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  DType dtype = DType::kBF16;
};

/// Layers "model.layers.<i>.attn" in one context, each with its own cache.
class Model {
 public:
  explicit Model(const ModelShape& shape) : shape_(shape) {
    for (int i = 0; i < shape.num_layers; ++i) {
      AttentionOptions o;
      o.num_heads = 2 * shape.num_kv_heads;
      o.num_kv_heads = shape.num_kv_heads;
      o.head_size = shape.head_size;
      o.scale = 0.3f;
      o.prefix = "model.layers." + std::to_string(i) + ".attn";
      o.dtype = shape.dtype;
      o.attn_backend = "ref";
      CacheConfig cache;
      cache.block_size = shape.block_size;
      cache.cache_dtype = shape.kv_cache_dtype;
      cache.layout = shape.layout;
      o.cache_config = cache;
      layers_.push_back(std::make_unique<Attention>(ctx_, o));
      caches_.push_back(KVCache::allocate(layers_.back()->config(), shape.num_blocks));
      layers_.back()->bind_kv_cache({caches_.back().view()});
    }
  }

  ForwardContext& context() { return ctx_; }
  Attention& layer(int i) { return *layers_[size_t(i)]; }
  KVCacheView cache(int i) const { return caches_[size_t(i)].view(); }
  int num_layers() const { return int(layers_.size()); }
  const ModelShape& shape() const { return shape_; }
  std::string name(int i) const { return layers_[size_t(i)]->name(); }

  /// The connector config for this model and `spec` ("storage:/dir", "redis://...").
  KVConnectorConfig connector_config(const std::string& spec,
                                     KVTransferRole role = KVTransferRole::kBoth) const {
    KVConnectorConfig c = parse_kv_connector_spec(spec);
    c.kv_role = role;
    c.model = "test-model";
    for (const auto& l : layers_) c.layers.push_back({l->name(), 0});
    c.block_size = shape_.block_size;
    c.num_kv_heads = shape_.num_kv_heads;
    c.head_size = shape_.head_size;
    c.kv_cache_dtype = shape_.kv_cache_dtype;
    c.cache_dtype = layers_.front()->config().cache_dtype();
    return c;
  }

  /// Random bytes in every block of every layer (seeded).
  void fill_random(uint32_t seed) {
    std::mt19937 rng(seed);
    for (const KVCache& c : caches_) {
      auto* p = static_cast<uint8_t*>(c.storage().data());
      const size_t n = c.storage().view().nbytes();
      for (size_t i = 0; i < n; ++i) p[i] = uint8_t(rng() & 0x7f);  // no fp8 NaN patterns
    }
  }
  /// Every byte of every cache set to `value`.
  void fill(uint8_t value) {
    for (const KVCache& c : caches_) {
      std::memset(c.storage().data(), value, c.storage().view().nbytes());
    }
  }
  /// Block `block` of layer `layer` in the stored (NHD) form.
  std::vector<uint8_t> block(int layer, int32_t block) const {
    std::vector<uint8_t> out(connector::block_bytes(cache(layer)));
    connector::gather_block(cache(layer), block, out.data());
    return out;
  }

 private:
  ModelShape shape_;
  ForwardContext ctx_;
  std::vector<std::unique_ptr<Attention>> layers_;
  std::vector<KVCache> caches_;
};

/// A metadata step with one request of `tokens` new tokens on `blocks` (for begin_step).
inline StepMetadata one_request_step(int block_size, int tokens, std::vector<int32_t> blocks) {
  return MetadataBuilder(block_size).add({0, tokens, std::move(blocks)}).build();
}

/// A block transfer of request 1, logical block `index` of `tokens` (chain hashes computed).
inline connector::BlockTransfer transfer_of(const std::vector<int32_t>& tokens, int block_size,
                                            int index, int32_t physical_block) {
  std::vector<uint64_t> hashes;
  extend_block_hashes(hashes, tokens, block_size);
  connector::BlockTransfer t;
  t.request_id = 1;
  t.block_index = index;
  t.hash = hashes[size_t(index)];
  t.parent_hash = index == 0 ? kNoParentHash : hashes[size_t(index - 1)];
  t.token_ids.assign(tokens.begin() + index * block_size,
                     tokens.begin() + (index + 1) * block_size);
  t.block_ids = {physical_block};
  return t;
}

/// Runs one worker step of `connector` over `model`: binds `meta`, begins a step (start_load_kv),
/// waits for each layer's load and saves it (what Attention::forward does around its
/// attention), ends the step (wait_for_save), and returns the blocks whose load failed.
inline std::vector<int32_t> run_worker_step(
    Model& model, KVConnector& connector, std::shared_ptr<connector::BlockTransferMetadata> meta) {
  ForwardContext& ctx = model.context();
  ctx.set_kv_connector(&connector);
  connector.bind_connector_metadata(meta);
  StepMetadata step = one_request_step(model.shape().block_size, 1, {1});
  AttentionMetadata md = step.view();
  ctx.begin_step({&md});
  for (int i = 0; i < model.num_layers(); ++i) {
    KVConnector* c = ctx.active_kv_connector();
    EXPECT_EQ(c, &connector);
    c->wait_for_layer_load(model.name(i));
    c->save_kv_layer(model.name(i), model.cache(i), md, model.layer(i).kv_scales());
  }
  ctx.end_step();
  std::vector<int32_t> errors = connector.get_block_ids_with_load_errors();
  connector.clear_connector_metadata();
  ctx.set_kv_connector(nullptr);
  return errors;
}

/// Token ids 0..n-1 shifted by `salt`.
inline std::vector<int32_t> tokens(int n, int salt = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[size_t(i)] = 100 * salt + i;
  return t;
}

#if PAGEDATTN_WITH_REDIS

/// Where redis-server is, or nullopt.
inline std::optional<std::string> redis_server_binary() {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  dirs += ":/usr/bin:/usr/sbin:/usr/local/bin";
  size_t pos = 0;
  while (pos <= dirs.size()) {
    size_t end = dirs.find(':', pos);
    if (end == std::string::npos) end = dirs.size();
    const std::string candidate = dirs.substr(pos, end - pos) + "/redis-server";
    if (end > pos && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    pos = end + 1;
  }
  return std::nullopt;
}

#define PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER()                                                   \
  do {                                                                                          \
    if (!::pagedattn::testing::redis_server_binary()) {                                         \
      GTEST_SKIP() << "redis-server is not installed (scripts/setup.sh installs Debian's "      \
                      "redis-server); the Redis connector tests need one to start on loopback"; \
    }                                                                                           \
  } while (0)

/// A redis-server of the test's own: 127.0.0.1, a free port, a temporary directory, no
/// snapshots; optionally a password and an append-only file (so a restart keeps the data).
class RedisServer {
 public:
  explicit RedisServer(std::string password = "", bool persistent = false)
      : password_(std::move(password)), persistent_(persistent) {
    port_ = free_port();
    start();
  }
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  int port() const { return port_; }
  /// redis://127.0.0.1:<port> (no password: the tests add it where they mean to).
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

  /// Starts the server (again) on the same port and directory and waits until it answers.
  void start() {
    const std::string bin = *redis_server_binary();
    std::vector<std::string> args = {bin,
                                     "--port",
                                     std::to_string(port_),
                                     "--bind",
                                     "127.0.0.1",
                                     "--dir",
                                     dir_.path(),
                                     "--save",
                                     "",
                                     "--logfile",
                                     dir_.path() + "/redis.log",
                                     "--appendonly",
                                     persistent_ ? "yes" : "no"};
    if (persistent_) {
      args.insert(args.end(), {"--appendfsync", "always"});
    }
    if (!password_.empty()) args.insert(args.end(), {"--requirepass", password_});
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(bin.c_str(), argv.data());
      ::_exit(127);
    }
    ASSERT_GT(pid_, 0) << "fork failed";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!ping()) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL() << "redis-server exited at start (port " << port_ << ")";
      }
      if (std::chrono::steady_clock::now() > deadline) FAIL() << "redis-server did not answer";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  /// Stops it (SIGTERM; with an append-only file its data survives a start()).
  void stop() { signal_and_wait(SIGTERM); }
  /// Kills it (SIGKILL), as a crash would.
  void kill() { signal_and_wait(SIGKILL); }
  /// Freezes and thaws it (requests then time out).
  void pause() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }

  /// A connection of the test's own (authenticated), for checks and tampering.
  redisContext* connect() const {
    timeval tv{2, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (c && !c->err && !password_.empty()) {
      freeReplyObject(redisCommand(c, "AUTH %s", password_.c_str()));
    }
    return c;
  }
  /// Keys matching `pattern`.
  std::vector<std::string> keys(const std::string& pattern = "*") const {
    std::vector<std::string> out;
    redisContext* c = connect();
    auto* r = static_cast<redisReply*>(redisCommand(c, "KEYS %s", pattern.c_str()));
    if (r && r->type == REDIS_REPLY_ARRAY) {
      for (size_t i = 0; i < r->elements; ++i) out.emplace_back(r->element[i]->str);
    }
    if (r) freeReplyObject(r);
    redisFree(c);
    return out;
  }
  /// SET key value (binary).
  void set(const std::string& key, const std::string& value) const {
    redisContext* c = connect();
    freeReplyObject(
        redisCommand(c, "SET %b %b", key.data(), key.size(), value.data(), value.size()));
    redisFree(c);
  }
  std::string get(const std::string& key) const {
    redisContext* c = connect();
    auto* r = static_cast<redisReply*>(redisCommand(c, "GET %b", key.data(), key.size()));
    std::string v = r && r->type == REDIS_REPLY_STRING ? std::string(r->str, r->len) : "";
    if (r) freeReplyObject(r);
    redisFree(c);
    return v;
  }

 private:
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    return ntohs(a.sin_port);
  }
  bool ping() const {
    timeval tv{0, 200000};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    bool ok = false;
    if (c && !c->err) {
      redisSetTimeout(c, tv);
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      // With a password, PING answers NOAUTH: the server is up all the same.
      ok = r != nullptr;
      if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return ok;
  }
  void signal_and_wait(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  TempDir dir_;
  std::string password_;
  bool persistent_ = false;
  int port_ = 0;
  pid_t pid_ = -1;
};

#endif  // PAGEDATTN_WITH_REDIS

}  // namespace pagedattn::testing
