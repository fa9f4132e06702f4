// The Redis connector against a redis-server of the test's own (loopback, free port, temporary
// directory): round trips and namespacing, password authentication, a server killed between
// lookup and load, a restarted server, a frozen server (timeouts), corrupted values, and no
// server at all. Every failure becomes misses, load errors and counters, never an exception
// or a partial block in a cache. Skips only when redis-server is not installed.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "connector/kv_entry.h"
#include "connector_test_util.h"

#if PAGEDATTN_WITH_REDIS

namespace pagedattn {
namespace {

using connector::BlockTransfer;
using connector::BlockTransferMetadata;
using testing::Model;
using testing::ModelShape;
using testing::RedisServer;
using testing::run_worker_step;
using testing::tokens;
using testing::transfer_of;

constexpr uint8_t kPoison = 0x3c;

struct Fixture {
  ModelShape shape;
  Model source{shape};
  std::vector<int32_t> prompt = tokens(13);
  std::vector<BlockTransfer> transfers;

  Fixture() {
    source.fill_random(11);
    for (int j = 0; j < 3; ++j) transfers.push_back(transfer_of(prompt, 4, j, 5 + 2 * j));
  }
  std::shared_ptr<BlockTransferMetadata> saves() const {
    auto m = std::make_shared<BlockTransferMetadata>();
    m->saves = transfers;
    return m;
  }
  std::shared_ptr<BlockTransferMetadata> loads(const std::vector<int32_t>& into) const {
    auto m = std::make_shared<BlockTransferMetadata>();
    for (size_t j = 0; j < into.size(); ++j) {
      m->loads.push_back(transfers[j]);
      m->loads.back().block_ids = {into[j]};
    }
    return m;
  }
  KVConnectorRequest request() const {
    KVConnectorRequest r;
    r.request_id = 1;
    r.token_ids = prompt;
    r.num_prompt_tokens = 13;
    return r;
  }
  std::string key(int j) const {
    const KVConnectorConfig c = source.connector_config("redis://127.0.0.1:1");
    return "pagedattn:kv:v1:" + c.namespace_name() + ":" +
           connector::hex64(transfers[size_t(j)].hash);
  }
};

KVConnectorStats save_all(Fixture& f, const KVConnectorConfig& config) {
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  run_worker_step(f.source, *worker, f.saves());
  worker->flush();
  return worker->stats();
}

TEST(RedisConnector, RoundTripAndNamespaces) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  RedisServer server;
  Fixture f;
  const KVConnectorConfig config = f.source.connector_config(server.url());
  EXPECT_EQ(save_all(f, config).saved_blocks, 3);
  const std::vector<std::string> keys =
      server.keys("pagedattn:kv:v1:test-model/auto-bfloat16/L3-H2-D8-B4:*");
  EXPECT_EQ(keys.size(), 3u);
  EXPECT_EQ(server.keys().size(), 3u);

  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
  // Another model (or cache dtype, or shape) has its own namespace: nothing found.
  KVConnectorConfig other = config;
  other.model = "other-model";
  auto other_sched = make_kv_connector(other, KVConnectorRole::kScheduler);
  EXPECT_EQ(other_sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 0);

  Model target(f.shape);
  target.fill(kPoison);
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  EXPECT_TRUE(run_worker_step(target, *worker, f.loads({3, 4, 9})).empty());
  EXPECT_EQ(worker->stats().loaded_blocks, 3);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(target.block(l, 3), f.source.block(l, 5));
    EXPECT_EQ(target.block(l, 4), f.source.block(l, 7));
    EXPECT_EQ(target.block(l, 9), f.source.block(l, 9));
  }
  // The value is the same safetensors entry the storage connector writes.
  const std::string value = server.get(f.key(0));
  EXPECT_NE(value.find("\"format\":\"pagedattn.kv_block\""), std::string::npos);
}

TEST(RedisConnector, PasswordAuthentication) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  RedisServer server("pw-123");
  Fixture f;
  const std::string hostport = std::to_string(server.port());
  // Right password in the URL.
  EXPECT_EQ(
      save_all(f, f.source.connector_config("redis://:pw-123@127.0.0.1:" + hostport)).saved_blocks,
      3);
  // No password: the server refuses every command; counted, logged, never thrown.
  std::vector<std::string> logs;
  KVConnectorConfig none = f.source.connector_config(server.url());
  none.log = [&logs](std::string_view m) { logs.emplace_back(m); };
  auto sched = make_kv_connector(none, KVConnectorRole::kScheduler);
  KVConnectorRequest r = f.request();
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 0).num_tokens, 0);
  sched->update_state_after_alloc(r, {}, 0);
  EXPECT_EQ(sched->stats().lookup_errors, 1);
  const KVConnectorStats saved = save_all(f, none);
  EXPECT_EQ(saved.saved_blocks, 0);
  EXPECT_EQ(saved.save_errors, 3);
  ASSERT_FALSE(logs.empty());
  EXPECT_THAT(logs[0], ::testing::HasSubstr("NOAUTH"));
  // A wrong password fails at connect.
  logs.clear();
  KVConnectorConfig wrong = f.source.connector_config("redis://:nope@127.0.0.1:" + hostport);
  wrong.log = none.log;
  auto wrong_sched = make_kv_connector(wrong, KVConnectorRole::kScheduler);
  EXPECT_EQ(wrong_sched->get_num_new_matched_tokens(r, 0).num_tokens, 0);
  ASSERT_FALSE(logs.empty());
  EXPECT_THAT(logs[0], ::testing::HasSubstr("AUTH failed"));
  // The password from the environment (kept off command lines).
  ::setenv("PAGEDATTN_REDIS_PASSWORD", "pw-123", 1);
  auto env_sched =
      make_kv_connector(f.source.connector_config(server.url()), KVConnectorRole::kScheduler);
  EXPECT_EQ(env_sched->get_num_new_matched_tokens(r, 0).num_tokens, 12);
  ::unsetenv("PAGEDATTN_REDIS_PASSWORD");
}

TEST(RedisConnector, ServerKilledBetweenLookupAndLoad) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  RedisServer server;
  Fixture f;
  const KVConnectorConfig config = f.source.connector_config(server.url() + "?retry_ms=0");
  save_all(f, config);
  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  server.kill();
  Model target(f.shape);
  target.fill(kPoison);
  EXPECT_EQ(run_worker_step(target, *worker, f.loads({3, 4, 9})), (std::vector<int32_t>{3, 4, 9}));
  EXPECT_EQ(worker->stats().unavailable_blocks, 3);
  EXPECT_EQ(worker->stats().loaded_blocks, 0);
  const std::vector<uint8_t> poison(size_t(2 * 4 * 2 * 8 * 2), kPoison);
  EXPECT_EQ(target.block(1, 4), poison);
  // The lookup misses while it is down, and the connector reconnects once it is back (empty:
  // the data was lost with the process).
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 0);
  server.start();
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 0);
  EXPECT_EQ(save_all(f, config).saved_blocks, 3);
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
}

TEST(RedisConnector, RestartedServerIsReconnected) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  RedisServer server("", /*persistent=*/true);
  Fixture f;
  const KVConnectorConfig config = f.source.connector_config(server.url());
  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  run_worker_step(f.source, *worker, f.saves());
  worker->flush();
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
  server.stop();
  server.start();  // the append-only file brings the entries back
  // Both connections went stale: the first command on each reconnects and retries.
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
  Model target(f.shape);
  EXPECT_TRUE(run_worker_step(target, *worker, f.loads({3, 4, 9})).empty());
  EXPECT_EQ(target.block(2, 9), f.source.block(2, 9));
  sched->update_state_after_alloc(f.request(), {}, 12);
  EXPECT_EQ(sched->stats().lookup_errors, 0);
}

TEST(RedisConnector, FrozenServerTimesOut) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  RedisServer server;
  Fixture f;
  const KVConnectorConfig config =
      f.source.connector_config(server.url() + "?timeout_ms=150&connect_timeout_ms=150&retry_ms=0");
  save_all(f, config);
  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
  server.pause();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 0);
  Model target(f.shape);
  EXPECT_EQ(run_worker_step(target, *worker, f.loads({3, 4, 9})).size(), 3u);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << "each operation gives up after its timeouts";
  server.resume();
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 12);
  EXPECT_TRUE(run_worker_step(target, *worker, f.loads({3, 4, 9})).empty());
}

TEST(RedisConnector, CorruptedValuesAreRejected) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  RedisServer server;
  Fixture f;
  const KVConnectorConfig config = f.source.connector_config(server.url());
  save_all(f, config);
  server.set(f.key(0), "not an entry");
  const std::string whole = server.get(f.key(1));
  server.set(f.key(1), whole.substr(0, whole.size() - 10));  // truncated
  std::string flipped = server.get(f.key(2));
  flipped[flipped.size() - 5] ^= 1;
  server.set(f.key(2), flipped);
  Model target(f.shape);
  target.fill(kPoison);
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  EXPECT_EQ(run_worker_step(target, *worker, f.loads({3, 4, 9})), (std::vector<int32_t>{3, 4, 9}));
  EXPECT_EQ(worker->stats().rejected_blocks, 3);
  const std::vector<uint8_t> poison(size_t(2 * 4 * 2 * 8 * 2), kPoison);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(target.block(l, 9), poison);
}

// A server on a loopback port that answers each connection's first command with a bulk
// string of 100000 bytes it trickles one byte per 20 ms: every read of the client finds a byte
// within any socket timeout, so only a deadline for the whole command ends the wait.
class TricklingServer {
 public:
  TricklingServer() {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(listener_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(listener_, 8) != 0 ||
        getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "cannot listen on a loopback port";
    }
    port_ = ntohs(a.sin_port);
    accepter_ = std::thread([this] { accept_loop(); });
  }
  ~TricklingServer() {
    stop_ = true;
    accepter_.join();
    for (std::thread& t : clients_) t.join();
    close(listener_);
  }
  int port() const { return port_; }

 private:
  void accept_loop() {
    while (!stop_) {
      pollfd p{listener_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const int fd = accept(listener_, nullptr, nullptr);
      if (fd >= 0) clients_.emplace_back([this, fd] { trickle(fd); });
    }
  }
  void trickle(int fd) {
    char buf[4096];
    if (recv(fd, buf, sizeof buf, 0) > 0) {
      const std::string head = "$100000\r\n";
      bool open = send(fd, head.data(), head.size(), MSG_NOSIGNAL) > 0;
      for (int i = 0; open && !stop_ && i < 500; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        open = send(fd, "x", 1, MSG_NOSIGNAL) > 0;
      }
    }
    close(fd);
  }
  int listener_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread accepter_;
  std::vector<std::thread> clients_;  // joined by the destructor (the accepter has stopped)
};

// timeout_ms bounds a whole command: three loads from a trickling server fail in about three
// timeouts (each read waiting only for what is left of its command's), not for as long as the
// server trickles (10 s each), and the log says they timed out.
TEST(RedisConnector, TricklingServerTimesOutByTheWholeCommand) {
  TricklingServer server;
  Fixture f;
  KVConnectorConfig config =
      f.source.connector_config("redis://127.0.0.1:" + std::to_string(server.port()) +
                                "?timeout_ms=150&connect_timeout_ms=150&retry_ms=0");
  std::mutex mu;
  std::vector<std::string> logs;
  config.log = [&](std::string_view m) {
    std::lock_guard<std::mutex> lock(mu);
    logs.emplace_back(m);
  };
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  Model target(f.shape);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(run_worker_step(target, *worker, f.loads({3, 4, 9})).size(), 3u);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 2.5) << "each GET gives up at its deadline";
  EXPECT_EQ(worker->stats().unavailable_blocks, 3);
  std::lock_guard<std::mutex> lock(mu);
  bool said = false;
  for (const std::string& m : logs) said = said || m.find("timed out") != std::string::npos;
  EXPECT_TRUE(said) << ::testing::PrintToString(logs);
}

TEST(RedisConnector, NoServerAtAll) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  int port = 0;
  {
    RedisServer server;  // a port that was free a moment ago and has no server now
    port = server.port();
  }
  Fixture f;
  std::vector<std::string> logs;
  KVConnectorConfig config = f.source.connector_config("redis://127.0.0.1:" + std::to_string(port));
  config.log = [&logs](std::string_view m) { logs.emplace_back(m); };
  const KVConnectorStats st = save_all(f, config);
  EXPECT_EQ(st.save_errors, 3);
  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);
  EXPECT_EQ(sched->get_num_new_matched_tokens(f.request(), 0).num_tokens, 0);
  ASSERT_FALSE(logs.empty());
  EXPECT_THAT(logs[0], ::testing::HasSubstr("Connection refused"));
}

}  // namespace
}  // namespace pagedattn

#endif  // PAGEDATTN_WITH_REDIS
