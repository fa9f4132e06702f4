// The connector interface: spec strings and options, config validation and namespaces, the
// registry, the shared block hash, CRC-32C, and the hooks Attention::forward and the
// ForwardContext call (in order, only when a connector holds metadata, never in a profiling
// step or for a KV-sharing consumer).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "connector/crc32c.h"
#include "connector_test_util.h"
#include "pagedattn/connector.h"
#include "pagedattn/error.h"
#include "sim/block_pool.h"

namespace pagedattn {
namespace {

using testing::Model;
using testing::ModelShape;

TEST(ConnectorSpec, StorageWithOptions) {
  const KVConnectorConfig c = parse_kv_connector_spec("storage:/tmp/kv store?fsync=0&io_threads=4");
  EXPECT_EQ(c.name, "storage");
  EXPECT_EQ(c.address, "/tmp/kv store");
  EXPECT_EQ(c.option("fsync"), "0");
  EXPECT_EQ(c.int_option("io_threads", 2, 1, 64), 4);
  EXPECT_EQ(c.int_option("max_inflight_mb", 256, 1, 1024), 256);
}

TEST(ConnectorSpec, RedisUrlForms) {
  KVConnectorConfig c = parse_kv_connector_spec("redis://10.1.2.3:7000");
  EXPECT_EQ(c.name, "redis");
  EXPECT_EQ(c.address, "10.1.2.3:7000");
  EXPECT_TRUE(c.options.empty());
  c = parse_kv_connector_spec("redis://localhost");
  EXPECT_EQ(c.address, "localhost:6379");
  c = parse_kv_connector_spec("redis://:s3cret@host:6380/2?timeout_ms=50");
  EXPECT_EQ(c.address, "host:6380");
  EXPECT_EQ(c.option("password"), "s3cret");
  EXPECT_EQ(c.option("username"), "");
  EXPECT_EQ(c.option("db"), "2");
  EXPECT_EQ(c.option("timeout_ms"), "50");
  c = parse_kv_connector_spec("redis://alice:pw@[::1]:6379");
  EXPECT_EQ(c.address, "::1:6379");
  EXPECT_EQ(c.option("username"), "alice");
  EXPECT_EQ(c.option("password"), "pw");
}

TEST(ConnectorSpec, ErrorsNameTheSpec) {
  EXPECT_ERROR(parse_kv_connector_spec("/tmp/dir"), InvalidArgument,
               "KV connector spec '/tmp/dir' has no kind; expected storage:/path or "
               "redis://host:port");
  EXPECT_ERROR(parse_kv_connector_spec("redis://host:99999"), InvalidArgument,
               "port '99999' is not in [1, 65535]");
  EXPECT_ERROR(parse_kv_connector_spec("redis:host"), InvalidArgument,
               "expected redis://host:port");
  EXPECT_ERROR(parse_kv_connector_spec("storage:/d?fsync"), InvalidArgument,
               "option 'fsync' is not key=value");
  EXPECT_ERROR(parse_kv_connector_spec("storage:"), InvalidArgument, "no address after 'storage:'");
  // The password never appears in a message.
  EXPECT_ERROR(parse_kv_connector_spec("redis://:hunter2@host:0"), InvalidArgument,
               "'redis://:***@host:0'");
}

TEST(ConnectorSpec, RedactionHidesPasswords) {
  EXPECT_EQ(redact_kv_connector_spec("redis://:pw@h:1/2"), "redis://:***@h:1/2");
  EXPECT_EQ(redact_kv_connector_spec("redis://bob:pw@h:1"), "redis://bob:***@h:1");
  EXPECT_EQ(redact_kv_connector_spec("redis://h:1?password=pw&db=1"),
            "redis://h:1?password=***&db=1");
  EXPECT_EQ(redact_kv_connector_spec("storage:/a@b"), "storage:/a@b");
}

TEST(ConnectorConfig, ValidationNamesFieldAndValue) {
  ModelShape shape;
  Model model(shape);
  KVConnectorConfig c = model.connector_config("storage:/tmp/x");
  c.validate();
  KVConnectorConfig bad = c;
  bad.block_size = 0;
  EXPECT_ERROR(bad.validate(), InvalidArgument, "block_size (0) must be >= 1");
  bad = c;
  bad.model.clear();
  EXPECT_ERROR(bad.validate(), InvalidArgument, "model is empty");
  bad = c;
  bad.layers.push_back(bad.layers.front());
  EXPECT_ERROR(bad.validate(), InvalidArgument, "layer name 'model.layers.0.attn' appears twice");
  bad = c;
  bad.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  EXPECT_ERROR(bad.validate(), InvalidArgument,
               "kv_cache_dtype fp8_e4m3 needs an fp8 cache_dtype; got bfloat16");
  bad = c;
  bad.options["io_threads"] = "0";
  EXPECT_ERROR(make_kv_connector(bad, KVConnectorRole::kWorker), InvalidArgument,
               "option io_threads='0' must be an integer in [1, 64]");
  bad = c;
  bad.options["fsynk"] = "0";
  EXPECT_ERROR(
      make_kv_connector(bad, KVConnectorRole::kWorker), InvalidArgument,
      "storage connector: unknown option 'fsynk' (known: fsync, io_threads, max_inflight_mb, "
      "max_load_staging_mb, fault)");
}

TEST(ConnectorConfig, NamespaceNamesModelDtypeAndShape) {
  ModelShape shape;
  Model model(shape);
  KVConnectorConfig c = model.connector_config("storage:/tmp/x");
  EXPECT_EQ(c.namespace_name(), "test-model/auto-bfloat16/L3-H2-D8-B4");
  c.model = "meta-llama/Llama 3";
  const std::string ns = c.namespace_name();
  EXPECT_EQ(ns.substr(0, 19), "meta-llama_Llama_3-") << ns;
  c.model = "meta-llama_Llama_3";  // the same text after replacement: another namespace
  EXPECT_NE(c.namespace_name(), ns);
  c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  c.cache_dtype = DType::kFp8E4M3;
  EXPECT_EQ(c.namespace_name(), "meta-llama_Llama_3/fp8_e4m3-float8_e4m3fn/L3-H2-D8-B4");
}

TEST(ConnectorRegistry, BuiltinsAndErrors) {
  const std::vector<std::string> names = default_kv_connector_registry().names();
  EXPECT_EQ(names, (std::vector<std::string>{"storage", "redis"}));
  ModelShape shape;
  Model model(shape);
  KVConnectorConfig c = model.connector_config("nixl:/x");
  EXPECT_ERROR(make_kv_connector(c, KVConnectorRole::kWorker), InvalidArgument,
               "KV connector 'nixl' is not registered; known connectors: storage, redis");
  KVConnectorRegistry r;
  const KVConnectorFactory none = [](const KVConnectorConfig&, KVConnectorRole) {
    return std::unique_ptr<KVConnector>();
  };
  r.add("mine", none);
  EXPECT_ERROR(r.add("mine", none), InvalidArgument, "connector 'mine' is already registered");
  EXPECT_ERROR(r.add("", none), InvalidArgument, "the name is empty");
  EXPECT_EQ(r.names(), std::vector<std::string>{"mine"});
}

TEST(BlockHash, OneImplementationForPrefixCachingAndConnectors) {
  // The sim's prefix caching uses the library's function (no second implementation).
  EXPECT_EQ(&sim::hash_block_tokens, &pagedattn::hash_block_tokens);
  EXPECT_EQ(sim::kNoParentHash, pagedattn::kNoParentHash);
  // The value keys external stores: it must never change (golden values).
  const std::vector<int32_t> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
  const uint64_t ha = hash_block_tokens(kNoParentHash, a);
  EXPECT_EQ(ha, 0xd47cd474ec330365ull);
  EXPECT_EQ(hash_block_tokens(ha, b), 0xda66c3ac3c27816aull);
  std::vector<uint64_t> chain;
  extend_block_hashes(chain, std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4);
  EXPECT_EQ(chain, (std::vector<uint64_t>{0xd47cd474ec330365ull, 0xda66c3ac3c27816aull}));
  extend_block_hashes(chain, std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4);
  EXPECT_EQ(chain.size(), 2u) << "already complete: nothing appended";
  EXPECT_ERROR(extend_block_hashes(chain, a, 0), InvalidArgument, "block_size (0) must be >= 1");
}

TEST(Crc32c, StandardVectorsAndBothPathsAgree) {
  const char* check = "123456789";
  EXPECT_EQ(connector::crc32c(check, 9), 0xE3069283u);
  EXPECT_EQ(connector::crc32c_portable(check, 9), 0xE3069283u);
  EXPECT_EQ(connector::crc32c(nullptr, 0), 0u);
  std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(connector::crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4
  std::mt19937 rng(7);
  std::vector<uint8_t> data(4099);
  for (auto& x : data) x = uint8_t(rng());
  for (const size_t n : {size_t(3), size_t(7), size_t(8), size_t(63), size_t(4099)}) {
    EXPECT_EQ(connector::crc32c(data.data(), n), connector::crc32c_portable(data.data(), n)) << n;
    // Continuing a CRC equals one pass.
    EXPECT_EQ(connector::crc32c(data.data() + 3, n - 3, connector::crc32c(data.data(), 3)),
              connector::crc32c(data.data(), n))
        << n;
  }
}

// Records the worker-side calls.
class RecordingConnector final : public KVConnector {
 public:
  RecordingConnector(const KVConnectorConfig& c) : KVConnector(c, KVConnectorRole::kWorker) {}
  std::string_view name() const override { return "recording"; }
  void start_load_kv(ForwardContext& context) override {
    calls.push_back("start_load_kv");
    EXPECT_TRUE(context.in_step());
  }
  void wait_for_layer_load(std::string_view layer) override {
    calls.push_back("wait " + std::string(layer));
  }
  void save_kv_layer(std::string_view layer, const KVCacheView& kv, const AttentionMetadata& md,
                     KVScales) override {
    calls.push_back("save " + std::string(layer));
    EXPECT_TRUE(kv.defined());
    EXPECT_EQ(md.num_actual_tokens, 3);
  }
  void wait_for_save() override { calls.push_back("wait_for_save"); }
  KVConnectorMatch get_num_new_matched_tokens(const KVConnectorRequest&, int) override {
    return {};
  }
  void update_state_after_alloc(const KVConnectorRequest&, std::span<const std::vector<int32_t>>,
                                int) override {}
  std::shared_ptr<const KVConnectorMetadata> build_connector_meta(
      const KVConnectorSchedulerOutput&) override {
    return std::make_shared<KVConnectorMetadata>();
  }
  KVConnectorStats stats() const override { return {}; }
  std::vector<std::string> calls;
};

class ConnectorHooks : public ::testing::Test {
 protected:
  ConnectorHooks() : model_(shape()), connector_(model_.connector_config("recording:x")) {}
  static ModelShape shape() {
    ModelShape s;
    s.num_layers = 2;
    s.dtype = DType::kF32;
    return s;
  }
  void forward_all() {
    const int64_t t = 3;
    Tensor q = Tensor::zeros({t, 4 * 8}, DType::kF32), kv = Tensor::zeros({t, 2 * 8}, DType::kF32);
    for (int i = 0; i < model_.num_layers(); ++i) model_.layer(i).forward(q, kv, kv);
  }
  Model model_;
  RecordingConnector connector_;
  StepMetadata step_ = testing::one_request_step(4, 3, {5});
  AttentionMetadata md_ = step_.view();
};

TEST_F(ConnectorHooks, CalledAroundEachLayerInOrder) {
  ForwardContext& ctx = model_.context();
  ctx.set_kv_connector(&connector_);
  connector_.bind_connector_metadata(std::make_shared<KVConnectorMetadata>());
  ctx.begin_step({&md_});
  EXPECT_EQ(ctx.active_kv_connector(), &connector_);
  forward_all();
  ctx.end_step();
  EXPECT_EQ(ctx.active_kv_connector(), nullptr);
  EXPECT_EQ(connector_.calls,
            (std::vector<std::string>{"start_load_kv", "wait model.layers.0.attn",
                                      "save model.layers.0.attn", "wait model.layers.1.attn",
                                      "save model.layers.1.attn", "wait_for_save"}));
}

TEST_F(ConnectorHooks, NoMetadataNoCalls) {
  ForwardContext& ctx = model_.context();
  ctx.set_kv_connector(&connector_);
  ctx.begin_step({&md_});
  EXPECT_EQ(ctx.active_kv_connector(), nullptr);
  forward_all();
  ctx.end_step();
  EXPECT_TRUE(connector_.calls.empty());
}

TEST_F(ConnectorHooks, ProfilingStepMovesNoKV) {
  ForwardContext& ctx = model_.context();
  ctx.set_kv_connector(&connector_);
  connector_.bind_connector_metadata(std::make_shared<KVConnectorMetadata>());
  ctx.begin_profile_step();
  EXPECT_EQ(ctx.active_kv_connector(), nullptr);
  forward_all();
  ctx.end_step();
  EXPECT_TRUE(connector_.calls.empty());
  EXPECT_EQ(ctx.kv_connector(), &connector_) << "the connector stays set for the next step";
}

TEST_F(ConnectorHooks, WithoutConnectorTheLayersRunAsBefore) {
  ForwardContext& ctx = model_.context();
  EXPECT_EQ(ctx.kv_connector(), nullptr);
  ctx.begin_step({&md_});
  EXPECT_EQ(ctx.active_kv_connector(), nullptr);
  forward_all();
  ctx.end_step();
}

TEST_F(ConnectorHooks, KVSharingConsumersAreNotHooked) {
  AttentionOptions o;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.head_size = 8;
  o.scale = 0.3f;
  o.dtype = DType::kF32;
  o.prefix = "model.layers.2.attn";
  o.kv_sharing_target_layer_name = "model.layers.0.attn";
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = 4;
  Attention consumer(model_.context(), o);
  ForwardContext& ctx = model_.context();
  ctx.set_kv_connector(&connector_);
  connector_.bind_connector_metadata(std::make_shared<KVConnectorMetadata>());
  ctx.begin_step({&md_});
  Tensor q = Tensor::zeros({3, 32}, DType::kF32);
  consumer.forward(q, TensorView{}, TensorView{});
  ctx.end_step();
  EXPECT_EQ(connector_.calls, (std::vector<std::string>{"start_load_kv", "wait_for_save"}));
}

TEST_F(ConnectorHooks, SetOnlyBetweenSteps) {
  ForwardContext& ctx = model_.context();
  ctx.begin_step({&md_});
  EXPECT_ERROR(ctx.set_kv_connector(&connector_), InvalidArgument,
               "set_kv_connector: called inside a step");
  ctx.end_step();
}

TEST_F(ConnectorHooks, WorkerHooksRefuseTheSchedulerRole) {
  KVConnectorConfig c = model_.connector_config("storage:/tmp/unused");
  auto scheduler = make_kv_connector(c, KVConnectorRole::kScheduler);
  EXPECT_ERROR(scheduler->bind_connector_metadata(std::make_shared<KVConnectorMetadata>()),
               InvalidArgument, "storage connector was built for the scheduler role");
  auto worker = make_kv_connector(c, KVConnectorRole::kWorker);
  EXPECT_ERROR(worker->bind_connector_metadata(std::make_shared<KVConnectorMetadata>()),
               InvalidArgument, "storage connector got metadata of another connector type");
  KVConnectorRequest r;
  EXPECT_ERROR(worker->get_num_new_matched_tokens(r, 0), InvalidArgument,
               "built for the worker role");
}

}  // namespace
}  // namespace pagedattn
