// Disaggregated prefill in the serving simulation (in process): a prefill instance saves the
// prompts' KV, a decode instance loads it, and the decode instance's outputs equal a
// single-instance run's bit for bit (digests of every token-producing row of every layer, on
// the batch-invariant ref backend). Corrupted entries and a Redis server killed and restarted
// in the middle of the decode run change only the counters: the decode side recomputes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "common/expect_error.h"
#include "connector_test_util.h"
#include "pagedattn/error.h"
#include "sim/simulation.h"

namespace pagedattn {
namespace {

using testing::TempDir;

sim::SimOptions base_options(const std::string& digest) {
  sim::SimOptions o;
  o.preset = "tiny";
  o.backend = "ref";
  o.measure_bandwidth = false;
  o.verify_every = 1;  // the decode side's attention is checked against the reference too
  o.workload.num_requests = 16;
  o.digest_file = digest;
  return o;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

struct Runs {
  TempDir dir;
  sim::SimReport single, prefill, decode;

  std::string path(const std::string& name) const { return dir.path() + "/" + name; }
  void run_single() {
    single = sim::run_simulation(base_options(path("single.digest")));
    ASSERT_TRUE(single.passed());
    EXPECT_EQ(single.digest_rows, 2 * single.workload_output_tokens);
  }
  void run_prefill(const std::string& spec) {
    sim::SimOptions o = base_options(path("prefill.digest"));
    o.kv_connector = spec;
    o.role = KVTransferRole::kProducer;
    prefill = sim::run_simulation(o);
    ASSERT_TRUE(prefill.passed());
  }
  void run_decode(const std::string& spec,
                  std::function<void(const sim::Progress&)> on_progress = nullptr) {
    sim::SimOptions o = base_options(path("decode.digest"));
    o.kv_connector = spec;
    o.role = KVTransferRole::kConsumer;
    o.on_progress = std::move(on_progress);
    decode = sim::run_simulation(o);
    EXPECT_TRUE(decode.passed());
  }
  void expect_same_outputs() const {
    const std::string a = slurp(path("single.digest")), b = slurp(path("decode.digest"));
    EXPECT_GT(a.size(), 100u);
    EXPECT_TRUE(a == b) << "the decode instance's outputs differ from the single instance's";
  }
};

TEST(DisaggregatedPrefill, DecodeMatchesSingleInstance) {
  Runs runs;
  runs.run_single();
  const std::string spec = "storage:" + runs.path("store");
  runs.run_prefill(spec);
  const KVConnectorStats& p = runs.prefill.connector;
  EXPECT_GT(p.saved_blocks, 0);
  EXPECT_EQ(p.save_errors, 0);
  EXPECT_EQ(runs.prefill.decode_tokens, 0) << "a prefill instance generates one token each";
  EXPECT_EQ(runs.prefill.role, "producer");

  runs.run_decode(spec);
  const KVConnectorStats& d = runs.decode.connector;
  EXPECT_EQ(runs.decode.role, "consumer");
  EXPECT_GT(d.hit_blocks, 0);
  EXPECT_EQ(d.loaded_blocks, d.hit_blocks);
  EXPECT_EQ(d.rejected_blocks, 0);
  EXPECT_EQ(d.saved_blocks, 0) << "a consumer saves nothing";
  EXPECT_EQ(runs.decode.external_hit_tokens, d.loaded_blocks * 16);
  EXPECT_LT(runs.decode.prefill_tokens, runs.single.prefill_tokens);
  EXPECT_EQ(runs.decode.decode_tokens, runs.single.decode_tokens);
  runs.expect_same_outputs();
}

TEST(DisaggregatedPrefill, CorruptedEntriesAreRecomputed) {
  Runs runs;
  runs.run_single();
  const std::string spec = "storage:" + runs.path("store");
  runs.run_prefill(spec);
  // Tear, truncate and corrupt three entries after the prefill instance wrote them.
  std::vector<std::filesystem::path> entries;
  for (const auto& e : std::filesystem::recursive_directory_iterator(runs.path("store"))) {
    if (e.is_regular_file()) entries.push_back(e.path());
  }
  std::sort(entries.begin(), entries.end());
  ASSERT_GE(entries.size(), 10u);
  std::filesystem::resize_file(entries[0], std::filesystem::file_size(entries[0]) / 2);
  {
    std::fstream f(entries[3], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-40, std::ios::end);
    f.put('\x7f');
  }
  std::filesystem::copy_file(entries[7], entries[6],
                             std::filesystem::copy_options::overwrite_existing);
  runs.run_decode(spec);
  const KVConnectorStats& d = runs.decode.connector;
  EXPECT_EQ(d.rejected_blocks, 3);
  EXPECT_EQ(d.loaded_blocks, d.hit_blocks - 3);
  EXPECT_GE(runs.decode.load_error_requests, 1);
  EXPECT_GT(runs.decode.load_error_tokens, 0);
  runs.expect_same_outputs();
}

TEST(DisaggregatedPrefill, EmptyStoreIsAllMisses) {
  Runs runs;
  runs.run_single();
  runs.run_decode("storage:" + runs.path("empty"));
  EXPECT_EQ(runs.decode.connector.hit_blocks, 0);
  EXPECT_GT(runs.decode.connector.miss_blocks, 0);
  EXPECT_EQ(runs.decode.prefill_tokens, runs.single.prefill_tokens);
  runs.expect_same_outputs();
}

TEST(DisaggregatedPrefill, BothRoleSavesAndReusesAcrossRuns) {
  Runs runs;
  runs.run_single();
  sim::SimOptions o = base_options(runs.path("both1.digest"));
  o.kv_connector = "storage:" + runs.path("store");
  const sim::SimReport first = sim::run_simulation(o);
  EXPECT_GT(first.connector.saved_blocks, 0);
  o.digest_file = runs.path("decode.digest");
  const sim::SimReport second = sim::run_simulation(o);
  EXPECT_GT(second.connector.loaded_blocks, 0);
  EXPECT_EQ(second.connector.saved_blocks, 0) << "everything was stored by the first run";
  EXPECT_TRUE(second.passed());
  runs.expect_same_outputs();
  EXPECT_EQ(slurp(runs.path("both1.digest")), slurp(runs.path("single.digest")));
}

TEST(DisaggregatedPrefill, RoleNeedsAConnector) {
  sim::SimOptions o = base_options("");
  o.role = KVTransferRole::kConsumer;
  EXPECT_ERROR(sim::run_simulation(o), InvalidArgument,
               "--role decode needs a KV connector (--connector storage:/dir or "
               "redis://host:port)");
  o.role = KVTransferRole::kBoth;
  o.kv_connector = "tape:/dev/st0";
  EXPECT_ERROR(sim::run_simulation(o), InvalidArgument, "KV connector 'tape' is not registered");
}

#if PAGEDATTN_WITH_REDIS

// Redis is killed two steps into the decode run and restarted (from its append-only file) two
// steps later: lookups in between miss, then hits resume; the outputs still match.
TEST(DisaggregatedPrefill, RedisRestartedMidRun) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  testing::RedisServer server("", /*persistent=*/true);
  Runs runs;
  runs.run_single();
  const std::string spec = server.url() + "?retry_ms=0";
  runs.run_prefill(spec);
  EXPECT_GT(runs.prefill.connector.saved_blocks, 0);
  bool killed = false, restarted = false;
  runs.run_decode(spec, [&](const sim::Progress& p) {
    if (p.step == 2) {
      server.kill();
      killed = true;
    }
    if (p.step == 4) {
      server.start();
      restarted = true;
    }
  });
  ASSERT_TRUE(killed && restarted);
  const KVConnectorStats& d = runs.decode.connector;
  EXPECT_GT(d.lookup_errors, 0) << "admissions while the server was down";
  EXPECT_GT(d.hit_blocks, 0);
  EXPECT_EQ(d.rejected_blocks, 0);
  runs.expect_same_outputs();
}

// The server loses everything in the middle of the decode run (a restart without persistence):
// the rest of the run recomputes.
TEST(DisaggregatedPrefill, RedisLosesItsDataMidRun) {
  PAGEDATTN_SKIP_WITHOUT_REDIS_SERVER();
  testing::RedisServer server;
  Runs runs;
  runs.run_single();
  const std::string spec = server.url() + "?retry_ms=0";
  runs.run_prefill(spec);
  runs.run_decode(spec, [&](const sim::Progress& p) {
    if (p.step == 2) {
      server.kill();
      server.start();
    }
  });
  const KVConnectorStats& d = runs.decode.connector;
  EXPECT_GT(d.hit_blocks, 0);
  EXPECT_GT(d.miss_blocks, 0);
  runs.expect_same_outputs();
}

#endif  // PAGEDATTN_WITH_REDIS

}  // namespace
}  // namespace pagedattn
