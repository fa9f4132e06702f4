// The "redis" connector: each entry is one Redis string value, key
//   pagedattn:kv:v1:<namespace>:<hash, 16 hex digits>
// set with one SET (Redis applies a command whole, so a reader sees the old value, none, or the
// new one whole), read with one GET. Several engines on several machines share one server.
// A lost connection, a timeout or a restarted server fails the operation at hand (a lookup is
// a miss, a load a load error, a save a counted error) and the next operation reconnects (a
// stale connection is retried once at once; after a failed connect, no new attempt for
// retry_ms). Password authentication (AUTH) and a database number come from the URL or the
// options.
#include "connector/builtin_connectors.h"
#include "pagedattn/error.h"

#if PAGEDATTN_WITH_REDIS

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

#include "connector/block_store.h"
#include "connector/block_store_connector.h"
#include "connector/kv_entry.h"

namespace pagedattn::connector {

using detail::cat;

namespace {

using Clock = std::chrono::steady_clock;

// hiredis writes with write(2): a server that went away would raise SIGPIPE, whose default
// action ends the process. Block it in this thread while hiredis runs, then discard one that
// arrived, leaving the process's disposition alone.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        sigset_t pipe;
        sigemptyset(&pipe);
        sigaddset(&pipe, SIGPIPE);
        const timespec zero{0, 0};
        sigtimedwait(&pipe, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t old_;
  bool was_pending_ = false;
};

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct RedisOptions {
  std::string host;
  int port = 6379;
  std::string username, password;
  int db = 0;
  int connect_timeout_ms = 1000;
  int timeout_ms = 1000;
  int retry_ms = 500;
  int64_t ttl_s = 0;
  std::string key_prefix;  // "pagedattn:kv:v1:<namespace>:"
  std::function<void(std::string_view)> log;
};

timeval to_timeval(int ms) {
  return timeval{ms / 1000, (ms % 1000) * 1000};
}

class RedisReader final : public EntryReader {
 public:
  explicit RedisReader(Reply reply) : reply_(std::move(reply)) {}
  uint64_t size() const override { return uint64_t(reply_->len); }
  bool read(uint64_t offset, void* dst, size_t n) override {
    if (offset > size() || n > size() - offset) return false;
    std::memcpy(dst, reply_->str + offset, n);
    return true;
  }

 private:
  Reply reply_;
};

class RedisStore final : public BlockStore {
 public:
  explicit RedisStore(const RedisOptions& o) : o_(o) {}
  ~RedisStore() override {
    if (ctx_) {
      SigpipeGuard guard;
      redisFree(ctx_);
    }
  }

  std::optional<size_t> count_present(std::span<const uint64_t> hashes) override {
    if (hashes.empty()) return 0;
    size_t present = 0;
    const bool ok = run([&](redisContext* c) {
      for (const uint64_t h : hashes) {
        const std::string k = key(h);
        if (redisAppendCommand(c, "EXISTS %b", k.data(), k.size()) != REDIS_OK) return kLost;
      }
      present = 0;
      bool counting = true, refused = false;
      for (size_t i = 0; i < hashes.size(); ++i) {
        void* raw = nullptr;
        if (!reply_by_deadline(c, &raw)) return kLost;
        const Reply r(static_cast<redisReply*>(raw));
        if (r->type != REDIS_REPLY_INTEGER) {
          note_reply_error("EXISTS", r.get());
          refused = true;
          continue;  // read every reply, so the connection stays in step
        }
        counting = counting && r->integer == 1;
        if (counting) ++present;
      }
      return refused ? kRefused : kDone;
    });
    if (!ok) return std::nullopt;
    return present;
  }

  OpenStatus open(uint64_t hash, std::unique_ptr<EntryReader>& reader) override {
    OpenStatus status = OpenStatus::kUnavailable;
    run([&](redisContext* c) {
      const std::string k = key(hash);
      if (redisAppendCommand(c, "GET %b", k.data(), k.size()) != REDIS_OK) return kLost;
      void* raw = nullptr;
      if (!reply_by_deadline(c, &raw)) return kLost;
      Reply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_NIL) {
        status = OpenStatus::kMissing;
      } else if (r->type == REDIS_REPLY_STRING) {
        status = OpenStatus::kOk;
        reader = std::make_unique<RedisReader>(std::move(r));
      } else {
        note_reply_error("GET", r.get());
        return kRefused;
      }
      return kDone;
    });
    return status;
  }

  bool put(uint64_t hash, std::span<const uint8_t> bytes, std::string& error) override {
    bool stored = false;
    const bool ok = run([&](redisContext* c) {
      const std::string k = key(hash);
      const int appended =
          o_.ttl_s > 0
              ? redisAppendCommand(c, "SET %b %b EX %lld", k.data(), k.size(), bytes.data(),
                                   bytes.size(), static_cast<long long>(o_.ttl_s))
              : redisAppendCommand(c, "SET %b %b", k.data(), k.size(), bytes.data(), bytes.size());
      if (appended != REDIS_OK) return kLost;
      void* raw = nullptr;
      if (!reply_by_deadline(c, &raw)) return kLost;
      Reply r(static_cast<redisReply*>(raw));
      stored = r->type == REDIS_REPLY_STATUS && std::strcmp(r->str, "OK") == 0;
      if (!stored) {
        last_error_ = cat("SET answered ", reply_text(r.get()));
        return kRefused;
      }
      return kDone;
    });
    if (!ok || !stored) error = last_error_;
    return ok && stored;
  }

 private:
  enum Outcome { kDone, kRefused, kLost };  // kRefused: the server answered with an error

  static std::string reply_text(const redisReply* r) {
    if (r->type == REDIS_REPLY_ERROR || r->type == REDIS_REPLY_STATUS) {
      return std::string(r->str, r->len);
    }
    return cat("a reply of type ", r->type);
  }
  void note_reply_error(const char* command, const redisReply* r) {
    last_error_ = cat(command, " answered ", reply_text(r));
  }

  std::string key(uint64_t hash) const { return o_.key_prefix + hex64(hash); }

  // The next reply of the operation under way, by its deadline (run() sets it timeout_ms after
  // the operation starts): the queued commands are written, then each read waits only for
  // what is left. hiredis's own blocking reads each wait up to the socket timeout, so a server
  // trickling its reply held a command for as long as it trickled. False: the connection
  // failed or the deadline passed (timed_out_), and the connection is dropped.
  bool reply_by_deadline(redisContext* c, void** out) {
    *out = nullptr;
    int written = 0;
    while (!written) {
      if (redisBufferWrite(c, &written) != REDIS_OK) return io_failed(c);
    }
    for (;;) {
      if (redisGetReplyFromReader(c, out) != REDIS_OK) return false;
      if (*out != nullptr) return true;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
      if (left.count() <= 0) {
        timed_out_ = true;
        return false;
      }
      if (redisSetTimeout(c, to_timeval(int(left.count()))) != REDIS_OK) return false;
      if (redisBufferRead(c) != REDIS_OK) return io_failed(c);
    }
  }
  // A socket timeout surfaces as an I/O error whose text is EAGAIN's ("Resource temporarily
  // unavailable"): recorded as the time-out it is.
  bool io_failed(const redisContext* c) {
    if (c->err == REDIS_ERR_IO && std::strcmp(c->errstr, std::strerror(EAGAIN)) == 0) {
      timed_out_ = true;
    }
    return false;
  }

  void warn(const std::string& message) {
    // One message per transition to "down", not one per operation.
    if (o_.log && !down_) o_.log(message);
    down_ = true;
  }

  bool connect() {
    ctx_ = redisConnectWithTimeout(o_.host.c_str(), o_.port, to_timeval(o_.connect_timeout_ms));
    std::string why;
    if (ctx_ == nullptr) {
      why = "cannot allocate a connection";
    } else if (ctx_->err) {
      why = ctx_->errstr;
    } else if (redisSetTimeout(ctx_, to_timeval(o_.timeout_ms)) != REDIS_OK) {
      why = "cannot set the timeout";
    } else if (!o_.password.empty()) {
      Reply r(static_cast<redisReply*>(
          o_.username.empty()
              ? redisCommand(ctx_, "AUTH %s", o_.password.c_str())
              : redisCommand(ctx_, "AUTH %s %s", o_.username.c_str(), o_.password.c_str())));
      if (!r) {
        why = ctx_->errstr;
      } else if (r->type != REDIS_REPLY_STATUS) {
        why = cat("AUTH failed: ", reply_text(r.get()));
      }
    }
    if (why.empty() && o_.db != 0) {
      Reply r(static_cast<redisReply*>(redisCommand(ctx_, "SELECT %d", o_.db)));
      if (!r) {
        why = ctx_->errstr;
      } else if (r->type != REDIS_REPLY_STATUS) {
        why = cat("SELECT ", o_.db, " failed: ", reply_text(r.get()));
      }
    }
    if (why.empty()) {
      if (down_ && o_.log) o_.log(cat("redis ", o_.host, ":", o_.port, " reachable again"));
      down_ = false;
      return true;
    }
    last_error_ = cat("redis ", o_.host, ":", o_.port, ": ", why);
    warn(last_error_ + "; lookups miss and transfers fail until it is back");
    if (ctx_) redisFree(ctx_);
    ctx_ = nullptr;
    retry_after_ = Clock::now() + std::chrono::milliseconds(o_.retry_ms);
    return false;
  }

  // Runs `op` on a connection. A lost connection that was open before (a restarted server, an
  // idle timeout) is reopened and `op` retried once; a failed connect backs off for retry_ms.
  template <class Op>
  bool run(Op&& op) {
    SigpipeGuard guard;
    for (int attempt = 0; attempt < 2; ++attempt) {
      bool fresh = false;
      if (ctx_ == nullptr) {
        if (Clock::now() < retry_after_) {
          last_error_ = cat("redis ", o_.host, ":", o_.port, " is down (retrying in a moment)");
          return false;
        }
        if (!connect()) return false;
        fresh = true;
      }
      timed_out_ = false;
      deadline_ = Clock::now() + std::chrono::milliseconds(o_.timeout_ms);
      redisSetTimeout(ctx_, to_timeval(o_.timeout_ms));  // the writes' bound (reads: the deadline)
      const Outcome outcome = op(ctx_);
      if (outcome == kDone) return true;
      if (outcome == kRefused) {
        warn(cat("redis ", o_.host, ":", o_.port, ": ", last_error_));
        return false;
      }
      last_error_ = timed_out_ ? cat("redis ", o_.host, ":", o_.port,
                                     ": timed out: no whole reply "
                                     "within timeout_ms=",
                                     o_.timeout_ms)
                               : cat("redis ", o_.host, ":", o_.port, ": ", ctx_->errstr);
      redisFree(ctx_);
      ctx_ = nullptr;
      if (timed_out_) {  // the deadline is the operation's: no second attempt
        warn(last_error_);
        return false;
      }
      if (fresh) {
        warn(last_error_ + "; lookups miss and transfers fail until it is back");
        retry_after_ = Clock::now() + std::chrono::milliseconds(o_.retry_ms);
        return false;
      }
    }
    return false;
  }

  RedisOptions o_;
  redisContext* ctx_ = nullptr;
  Clock::time_point retry_after_{};
  Clock::time_point deadline_{};  // of the operation under way (run)
  bool timed_out_ = false;        // it passed its deadline
  bool down_ = false;
  std::string last_error_;
};

}  // namespace

std::unique_ptr<KVConnector> make_redis_connector(const KVConnectorConfig& config,
                                                  KVConnectorRole role) {
  check_known_options(config,
                      {"username", "password", "db", "timeout_ms", "connect_timeout_ms", "retry_ms",
                       "ttl_s", "io_threads", "max_inflight_mb", "max_load_staging_mb"});
  RedisOptions o;
  const size_t colon = config.address.rfind(':');
  detail::require(colon != std::string::npos && colon > 0, "redis connector: address '",
                  config.address, "' is not host:port");
  o.host = config.address.substr(0, colon);
  o.port = std::atoi(config.address.c_str() + colon + 1);
  o.username = config.option("username");
  o.password = config.option("password");
  if (o.password.empty()) {
    // Keeps the password off command lines (and out of `ps`).
    if (const char* env = std::getenv("PAGEDATTN_REDIS_PASSWORD")) o.password = env;
  }
  o.db = int(config.int_option("db", 0, 0, 1 << 20));
  o.connect_timeout_ms = int(config.int_option("connect_timeout_ms", 1000, 1, 600'000));
  o.timeout_ms = int(config.int_option("timeout_ms", 1000, 1, 600'000));
  o.retry_ms = int(config.int_option("retry_ms", 500, 0, 600'000));
  o.ttl_s = config.int_option("ttl_s", 0, 0, int64_t(1) << 40);
  o.key_prefix = cat("pagedattn:kv:v1:", config.namespace_name(), ":");
  // The stores of several threads and the connector log through one function: one call at a
  // time, as KVConnectorConfig::log promises.
  KVConnectorConfig c = config;
  if (config.log) {
    auto mu = std::make_shared<std::mutex>();
    c.log = [log = config.log, mu](std::string_view m) {
      std::lock_guard<std::mutex> lock(*mu);
      log(m);
    };
    o.log = [log = c.log](std::string_view m) { log(cat("redis connector: ", m)); };
  }
  return std::make_unique<BlockStoreConnector>(c, role, "redis",
                                               [o] { return std::make_unique<RedisStore>(o); });
}

}  // namespace pagedattn::connector

#else  // built without hiredis

namespace pagedattn::connector {

std::unique_ptr<KVConnector> make_redis_connector(const KVConnectorConfig&, KVConnectorRole) {
  detail::fail<NotSupported>(
      "the redis connector is not in this build: hiredis was not found when it was configured "
      "(scripts/setup.sh installs libhiredis-dev)");
}

}  // namespace pagedattn::connector

#endif
