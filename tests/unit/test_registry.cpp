// Backend selection: priority order, overrides by argument and environment, no fallback, and
// an error that lists every backend with its reasons.
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"

namespace pagedattn {
namespace {

// A backend that supports only the head sizes it is given.
class FakeBackend final : public Backend {
 public:
  FakeBackend(std::string name, std::vector<int> head_sizes)
      : name_(std::move(name)), head_sizes_(std::move(head_sizes)) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return "test backend"; }
  std::vector<std::string> check(const BackendQuery& q) const override {
    for (int h : head_sizes_)
      if (h == q.config.head_size) return {};
    return {detail::cat("head_size ", q.config.head_size, " not supported")};
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig&, Device) const override {
    return nullptr;
  }

 private:
  std::string name_;
  std::vector<int> head_sizes_;
};

BackendQuery query_with_head_size(int head_size) {
  BackendQuery q;
  q.config.num_heads = q.config.num_kv_heads = 4;
  q.config.head_size = head_size;
  q.config.scale = 1.0f;
  return q;
}

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv(kBackendEnvVar);
    r_.add(std::make_unique<FakeBackend>("fast", std::vector<int>{64, 128}));
    r_.add(std::make_unique<FakeBackend>("slow", std::vector<int>{64, 80, 128}));
  }
  void TearDown() override { unsetenv(kBackendEnvVar); }
  Registry r_;
};

TEST_F(RegistryTest, FirstSupportedInPriorityOrder) {
  EXPECT_EQ(r_.select(query_with_head_size(128)).name(), "fast");
  EXPECT_EQ(r_.select(query_with_head_size(80)).name(), "slow");
}

TEST_F(RegistryTest, NothingFitsListsEveryBackendsReasons) {
  EXPECT_ERROR(r_.select(query_with_head_size(96)), NotSupported,
               "no attention backend supports this configuration");
  try {
    r_.select(query_with_head_size(96));
  } catch (const NotSupported& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("fast     no: head_size 96 not supported"), std::string::npos) << msg;
    EXPECT_NE(msg.find("slow     no: head_size 96 not supported"), std::string::npos) << msg;
  }
}

TEST_F(RegistryTest, OverrideByArgumentNeverFallsBack) {
  EXPECT_EQ(r_.select(query_with_head_size(128), "slow").name(), "slow");
  EXPECT_ERROR(r_.select(query_with_head_size(80), "fast"), NotSupported,
               "selected backend 'fast' is not valid for this configuration");
}

TEST_F(RegistryTest, UnknownOverrideListsValidNames) {
  EXPECT_ERROR(r_.select(query_with_head_size(128), "flash"), InvalidArgument,
               "backend 'flash' is not a registered backend; valid backends: fast, slow");
}

TEST_F(RegistryTest, EnvironmentOverride) {
  setenv(kBackendEnvVar, "slow", 1);
  EXPECT_EQ(r_.select(query_with_head_size(128)).name(), "slow");
  EXPECT_EQ(r_.select(query_with_head_size(128), std::nullopt, /*use_env=*/false).name(), "fast");
  setenv(kBackendEnvVar, "nope", 1);
  EXPECT_ERROR(r_.select(query_with_head_size(128)), InvalidArgument,
               "PAGEDATTN_BACKEND 'nope' is not a registered backend");
}

TEST_F(RegistryTest, DuplicateNamesRejected) {
  EXPECT_ERROR(r_.add(std::make_unique<FakeBackend>("fast", std::vector<int>{})), InvalidArgument,
               "a backend named 'fast' is already registered");
}

TEST_F(RegistryTest, ExplainGivesEveryVerdictInOrder) {
  const auto v = r_.explain(query_with_head_size(80));
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].name, "fast");
  EXPECT_FALSE(v[0].supported());
  EXPECT_TRUE(v[1].supported());
  EXPECT_NE(format_verdicts(v).find("slow     supported"), std::string::npos);
}

TEST(DefaultRegistry, HasTheReferenceBackend) {
  unsetenv(kBackendEnvVar);
  const Backend* ref = default_registry().find("ref");
  ASSERT_NE(ref, nullptr);
  BackendQuery gpu = query_with_head_size(128);
  gpu.device = Device::cuda(0);
  EXPECT_FALSE(ref->check(gpu).empty());
  EXPECT_TRUE(ref->check(query_with_head_size(128)).empty());
}

}  // namespace
}  // namespace pagedattn
