// Backend selection: priority order, overrides by argument and environment, no fallback, and
// an error that lists every backend with its reasons.
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/expect_error.h"
#include "core/option_table.h"
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

// A backend with options through the option table (core/option_table.h), as the cpu and cuda
// backends have theirs.
struct FakeOptions {
  int mode = 0;
  int count = 0;
};

const std::vector<detail::OptionField<FakeOptions>>& fake_option_table() {
  static const std::vector<detail::OptionField<FakeOptions>> table = {
      {{"mode", "how it runs", {{"auto", 0}, {"fast", 1}, {"safe", 2}}},
       [](const FakeOptions& o) { return o.mode; },
       [](FakeOptions& o, int v) { o.mode = v; }},
      {{"count", "how many", {{"auto", 0}}, 1, 8},
       [](const FakeOptions& o) { return o.count; },
       [](FakeOptions& o, int v) { o.count = v; }},
  };
  return table;
}

class OptionBackend final : public Backend {
 public:
  explicit OptionBackend(FakeOptions o = {}) : o_(o) {}
  std::string_view name() const override { return "opt"; }
  std::string_view description() const override { return "test backend with options"; }
  std::vector<std::string> check(const BackendQuery&) const override { return {}; }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionConfig&, Device) const override {
    return nullptr;
  }
  std::vector<BackendOptionInfo> options() const override {
    return detail::describe_options(fake_option_table(), o_);
  }
  std::unique_ptr<Backend> configured(const std::vector<std::string>& settings) const override {
    return std::make_unique<OptionBackend>(
        detail::with_settings(fake_option_table(), o_, settings, "opt backend"));
  }

 private:
  FakeOptions o_;
};

std::string option_value(const Backend& b, std::string_view name) {
  for (const BackendOptionInfo& i : b.options()) {
    if (i.name == name) return i.value;
  }
  return "?";
}

TEST(Registry, ConfigureReplacesABackendWithItsOptionsOverTheCurrentOnes) {
  Registry r;
  r.add(std::make_unique<FakeBackend>("first", std::vector<int>{64}));
  r.add(std::make_unique<OptionBackend>());
  r.add(std::make_unique<FakeBackend>("last", std::vector<int>{64}));
  const Backend* before = r.find("opt");
  const std::vector<BackendOptionInfo> infos = before->options();
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].value, "auto");
  EXPECT_EQ(infos[0].allowed, (std::vector<std::string>{"auto", "fast", "safe"}));
  EXPECT_EQ(infos[1].allowed, (std::vector<std::string>{"auto", "an integer in [1, 8]"}));
  EXPECT_EQ(infos[1].help, "how many");
  r.configure("opt", {"mode=fast", "count=3", "count=5"});  // in order: the last wins
  const Backend* after = r.find("opt");
  EXPECT_NE(after, before);
  EXPECT_EQ(r.backends()[1], after);  // its place in the priority order
  EXPECT_EQ(option_value(*after, "mode"), "fast");
  EXPECT_EQ(option_value(*after, "count"), "5");
  EXPECT_EQ(option_value(*before, "mode"), "auto");  // the old one lives on, unchanged
  r.configure("opt", {"count=auto"});
  EXPECT_EQ(option_value(*r.find("opt"), "mode"), "fast");
  EXPECT_EQ(option_value(*r.find("opt"), "count"), "auto");
  r.configure("opt", {});  // nothing to set: the same backend
  EXPECT_EQ(option_value(*r.find("opt"), "count"), "auto");
}

TEST(Registry, ConfigureErrorsNameTheOptionTheValueAndWhatIsAllowed) {
  Registry r;
  r.add(std::make_unique<OptionBackend>());
  r.add(std::make_unique<FakeBackend>("plain", std::vector<int>{64}));
  const Backend* kept = r.find("opt");
  EXPECT_ERROR(r.configure("opt", {"count=9"}), InvalidArgument,
               "opt backend option 'count': '9' is not auto or an integer in [1, 8]");
  EXPECT_ERROR(r.configure("opt", {"mode=Fast"}), InvalidArgument,
               "opt backend option 'mode': 'Fast' is not auto, fast or safe");
  for (const char* bad : {"count=", "count=0", "count=+3", "count=3x", "count= 3"}) {
    EXPECT_ERROR(r.configure("opt", {bad}), InvalidArgument, "option 'count'");
  }
  EXPECT_ERROR(r.configure("opt", {"modes=fast"}), InvalidArgument,
               "opt backend has no option 'modes'; its options: mode, count");
  EXPECT_ERROR(r.configure("opt", {"fast"}), InvalidArgument,
               "opt backend: 'fast' is not a setting of the form name=value");
  // A bad setting after good ones changes nothing.
  EXPECT_ERROR(r.configure("opt", {"mode=fast", "count=0"}), InvalidArgument, "'count'");
  EXPECT_EQ(r.find("opt"), kept);
  EXPECT_EQ(option_value(*kept, "mode"), "auto");
  EXPECT_ERROR(r.configure("plain", {"x=1"}), InvalidArgument,
               "backend 'plain' has no options; got 'x=1'");
  EXPECT_ERROR(r.configure("none", {"x=1"}), InvalidArgument,
               "backend 'none' is not a registered backend; valid backends: opt, plain");
}

#if PAGEDATTN_WITH_CPU_BACKEND
// The cpu backend's one option, the thread count its plans spread work over.
TEST(DefaultRegistry, CpuThreadsOption) {
  Registry& r = default_registry();
  const Backend* cpu = r.find("cpu");
  ASSERT_NE(cpu, nullptr);
  const std::string saved = option_value(*cpu, "threads");
  r.configure("cpu", {"threads=3"});
  EXPECT_EQ(option_value(*r.find("cpu"), "threads"), "3");
  EXPECT_ERROR(r.configure("cpu", {"threads=0"}), InvalidArgument,
               "cpu backend option 'threads': '0' is not auto or an integer in [1, 4096]");
  r.configure("cpu", {"threads=" + saved});
  EXPECT_EQ(option_value(*r.find("cpu"), "threads"), saved);
}
#endif

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
