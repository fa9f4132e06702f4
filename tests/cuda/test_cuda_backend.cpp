// The cuda backend against the float64 reference, through the public API. Tests that need a
// GPU skip (GTEST_SKIP) when none is usable, so CI, which has none, runs only the host-side
// ones (check() reasons, the split planner). bench/gpu/run.sh runs the rest on a GPU machine.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend_ops/cases.h"
#include "backend_ops/harness.h"
#include "common/expect_error.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/backend/plan.h"
#include "cuda/backend/q_map.h"
#include "cuda/common/device_props.h"
#include "cuda/decode/launch.h"
#include "cuda/mla/launch.h"
#include "cuda/prefill/launch.h"
#include "cuda/prefill/walk.h"
#include "pagedattn/accuracy.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "pagedattn/registry.h"
#include "ref/ref_backend.h"

namespace pagedattn {
namespace {

AttentionConfig gqa_config(DType dtype = DType::kBF16, int head_size = 128) {
  AttentionConfig c;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_size = head_size;
  c.scale = 1.0f / std::sqrt(float(head_size));
  c.dtype = dtype;
  c.block_size = 16;
  return c;
}

// Empty when a GPU this backend serves is present; else why the test is skipped.
std::string gpu_unavailable() {
  DeviceRuntime* rt = device_runtime(DeviceType::kCUDA);
  if (rt == nullptr || rt->device_count() == 0) return "no CUDA device is visible";
  const auto backend = cuda::make_backend(cuda::BackendOptions{});
  std::string why;
  for (const auto& r : backend->check({gqa_config(), Device::cuda(0)})) why += r + "; ";
  return why;
}

#define REQUIRE_GPU()                                                                 \
  do {                                                                                \
    if (const std::string why = gpu_unavailable(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// ---- host side: runs everywhere -------------------------------------------------------------

TEST(CudaBackendHost, RegisteredBeforeRefAndRefusesHostTensors) {
  const auto backends = default_registry().backends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends.front()->name(), "cuda");
  const auto reasons = backends.front()->check({gqa_config(), Device::cpu()});
  ASSERT_FALSE(reasons.empty());
  EXPECT_NE(reasons[0].find("runs on CUDA devices only"), std::string::npos) << reasons[0];
}

// Every head size from 8 to 256 in steps of 8 (16 over an fp8 cache) runs on the smallest
// compiled instance that holds it (its bucket), decode and prefill alike; other sizes are
// refused with a reason that names the rule.
TEST(CudaBackendHost, HeadSizesRunOnTheSmallestCompiledInstanceThatHoldsThem) {
  for (const DType cache : {DType::kBF16, DType::kFp8E4M3}) {
    const std::vector<int> compiled = cuda::decode::compiled_head_sizes(
        DType::kBF16, cache == DType::kBF16 ? cuda::attn::KVKind::kSame : cuda::attn::KVKind::kFp8);
    ASSERT_FALSE(compiled.empty());
    const int step = cache == DType::kBF16 ? 8 : 16;
    for (int d = 1; d <= 264; ++d) {
      SCOPED_TRACE(detail::cat("head_size ", d, " over ", dtype_name(cache)));
      const cuda::decode::DecodeKernel* k = cuda::decode::find_decode(DType::kBF16, cache, d);
      const cuda::prefill::PrefillKernel* pk =
          cuda::prefill::find_prefill(DType::kBF16, cache, d, 9);
      int bucket = 0;
      for (int s : compiled) {
        if (s >= d) {
          bucket = s;
          break;
        }
      }
      if (d % step != 0 || d > 256 || bucket == 0) {
        EXPECT_EQ(k, nullptr);
        EXPECT_EQ(pk, nullptr);
        continue;
      }
      ASSERT_NE(k, nullptr);
      EXPECT_EQ(k->head_size, bucket);
      ASSERT_NE(pk, nullptr);
      EXPECT_EQ(pk->head_size, bucket);
      if (cache == DType::kBF16) {
        EXPECT_EQ(pk->sm, cuda::hopper_code_compiled() ? 90 : 80);
      }
    }
  }
  // float32 runs on the generic kernel at every multiple of 8.
  EXPECT_NE(cuda::decode::find_decode(DType::kF32, DType::kF32, 72), nullptr);
  EXPECT_EQ(cuda::decode::find_decode(DType::kF32, DType::kF32, 59), nullptr);

  const auto backend = cuda::make_backend(cuda::BackendOptions{});
  auto reasons = [&](AttentionConfig c) {
    std::string all;
    for (const auto& r : backend->check({c, Device::cuda(0)})) all += r + "\n";
    return all;
  };
  AttentionConfig c = gqa_config(DType::kBF16, 72);
  EXPECT_EQ(reasons(c).find("head_size"), std::string::npos) << reasons(c);
  c.head_size = 59;
  EXPECT_NE(reasons(c).find("head_size 59 over a bfloat16 cache: the cuda kernels take head sizes "
                            "from 8 to 256 in steps of 8"),
            std::string::npos)
      << reasons(c);
  c.head_size = 72;
  c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  EXPECT_NE(reasons(c).find("in steps of 16"), std::string::npos) << reasons(c);
  c.dtype = DType::kF32;
  c.kv_cache_dtype = KVCacheDType::kAuto;
  EXPECT_EQ(reasons(c).find("head_size"), std::string::npos) << reasons(c);
}

// A V head size of its own (AttentionConfig::v_head_size) runs, with the option v_head=on, on
// K's instance where V's rows are whole 16-byte chunks; other V widths, and a v_head_size beside
// the MLA shape, are refused with their reason. Off (the default) refuses it.
TEST(CudaBackendHost, VHeadSizesOfTheirOwnWhereTheirRowsAreWholeChunks) {
  AttentionConfig c = gqa_config(DType::kBF16, 192);
  c.v_head_size = 128;
  {
    std::string all;
    for (const auto& r : cuda::make_backend(cuda::BackendOptions{})->check({c, Device::cuda(0)})) {
      all += r + "\n";
    }
    EXPECT_NE(all.find("v_head_size 128 differs from head_size 192: the cuda kernels take it with "
                       "the option v_head=on"),
              std::string::npos)
        << all;
  }
  cuda::BackendOptions on;
  on.v_head = true;
  const auto backend = cuda::make_backend(on);
  auto reasons = [&](AttentionConfig x) {
    std::string all;
    for (const auto& r : backend->check({x, Device::cuda(0)})) all += r + "\n";
    return all;
  };
  EXPECT_EQ(reasons(c).find("v_head_size"), std::string::npos) << reasons(c);
  c.head_size = 72;
  c.v_head_size = 40;
  EXPECT_EQ(reasons(c).find("v_head_size"), std::string::npos) << reasons(c);
  c.v_head_size = 36;
  EXPECT_NE(reasons(c).find("v_head_size 36 over a bfloat16 cache: the cuda kernels take V head "
                            "sizes from 8 to 256 in steps of 8"),
            std::string::npos)
      << reasons(c);
  c.v_head_size = 40;
  c.head_size = 64;
  c.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  EXPECT_NE(reasons(c).find("v_head_size 40 over a float8_e4m3fn cache"), std::string::npos)
      << reasons(c);
  c.v_head_size = 32;
  EXPECT_EQ(reasons(c).find("v_head_size"), std::string::npos) << reasons(c);
}

cuda::SplitInputs inputs(int batch, int kv_len, int q_len = 1) {
  cuda::SplitInputs in;
  in.num_sms = 132;
  in.ctas_per_sm = 2;
  in.num_kv_heads = 8;
  in.group = 4;
  in.q_lens.assign(size_t(batch), q_len);
  in.kv_lens.assign(size_t(batch), kv_len);
  return in;
}

TEST(CudaBackendHost, SplitHeuristicFillsTheMachineOnlyWhenNeeded) {
  // One long request on 8 KV heads: 8 CTAs unsplit; splitting fills the 264 slots.
  const int s1 = cuda::choose_num_splits(inputs(1, 32768));
  EXPECT_GE(8 * s1, 0.9 * 264) << s1;
  EXPECT_LE(s1, 64);
  // A batch that already fills the machine stays unsplit.
  EXPECT_EQ(cuda::choose_num_splits(inputs(64, 4096)), 1);
  // Short contexts never split below kMinSplitTokens keys per split.
  EXPECT_EQ(cuda::choose_num_splits(inputs(1, 255)), 1);
  EXPECT_LE(cuda::choose_num_splits(inputs(1, 1024)), 4);
  // Without occupancy information (no device): no split.
  cuda::SplitInputs none = inputs(1, 32768);
  none.ctas_per_sm = 0;
  EXPECT_EQ(cuda::choose_num_splits(none), 1);
}

TEST(CudaBackendHost, SplitHeuristicWeighsPrefillCtasByTheirOccupancy) {
  // Chunked prefill, 8 query heads on 1 KV head, over 32k keys: q * 8 rows on 128-row CTAs of
  // a kernel that holds a whole SM. q1024 (64 CTAs) fills 132 SMs with 2 splits, q256 (16)
  // with 8; counted as decode CTAs (2 per SM) they took 4 and 15-16.
  auto chunked = [](int q_len) {
    cuda::SplitInputs in = inputs(1, 32768 + q_len, q_len);
    in.num_kv_heads = 1;
    in.group = 8;
    in.route_rows = 64;
    in.prefill_ctas_per_sm = 1;
    return in;
  };
  EXPECT_EQ(cuda::choose_num_splits(chunked(1024)), 2);
  EXPECT_EQ(cuda::choose_num_splits(chunked(256)), 8);
  // The same CTAs at the decode kernel's occupancy: the old count, twice the splits.
  cuda::SplitInputs same = chunked(1024);
  same.prefill_ctas_per_sm = 0;
  EXPECT_EQ(cuda::choose_num_splits(same), 4);
  // Decode rows alone are unaffected by the prefill kernel's occupancy.
  cuda::SplitInputs decode = inputs(1, 32768);
  decode.prefill_ctas_per_sm = 1;
  EXPECT_EQ(cuda::choose_num_splits(decode), cuda::choose_num_splits(inputs(1, 32768)));
}

// MLA steps put each request's rows on CTAs of the kernel's block_m (route_rows 0). backend_ops'
// 8 requests of ~600 keys at 16 heads plan 2 splits on a 132-SM GPU (the cluster merge's case);
// 2 requests of 2500 keys more than kMaxClusterSplits (the combine kernel's).
TEST(CudaBackendHost, SplitHeuristicForMlaSteps) {
  auto mla = [](int batch, int kv_len, int q_len, int block_m) {
    cuda::SplitInputs in = inputs(batch, kv_len, q_len);
    in.ctas_per_sm = 1;
    in.num_kv_heads = 1;
    in.group = 16;
    in.route_rows = 0;
    in.prefill_block_m = block_m;
    return in;
  };
  EXPECT_EQ(cuda::choose_num_splits(mla(8, 601, 1, 16)), 2);
  EXPECT_EQ(cuda::choose_num_splits(mla(8, 562, 2, 32)), 2);
  EXPECT_GT(cuda::choose_num_splits(mla(2, 2502, 2, 32)), cuda::mla::kMaxClusterSplits);
  // b64 c4096, 16 heads x 1 (bench_mla's point): 2 splits, 128 CTAs.
  EXPECT_EQ(cuda::choose_num_splits(mla(64, 4096, 1, 16)), 2);
}

TEST(CudaBackendHost, PlanSizesTheWorkspaceForItsSplits) {
  const AttentionConfig c = gqa_config();
  StepMetadata step = MetadataBuilder(16).add({8000, 1, std::vector<int32_t>(501, 1)}).build();
  const AttentionMetadata md = step.view();
  const auto plan = cuda::make_plan(md, c, 132, 2);
  ASSERT_GT(plan->num_splits, 1);
  EXPECT_EQ(plan->workspace_bytes(),
            cuda::split_workspace_bytes(plan->num_splits, 1, c.num_heads, c.head_size));
  EXPECT_GE(plan->workspace_bytes(),
            size_t(plan->num_splits) * c.num_heads * (c.head_size + 1) * 4);
  EXPECT_EQ(cuda::make_plan(md, c, 0, 0)->workspace_bytes(), 0u);
}

// The Hopper prefill switches read from the environment: values, defaults, and errors that name
// the variable.
TEST(CudaBackendHost, QueryMapTakesWholeBoxesOfAlignedRows) {
  void* const base = reinterpret_cast<void*>(uintptr_t(1) << 20);
  cuda::QMapShape q;
  const char* why = nullptr;
  // GQA 32/8, d128: one box per panel of 4 heads x 32 tokens, the work tile's 128 packed rows.
  const TensorView dense = TensorView::contiguous(base, DType::kBF16, {1000, 32, 128});
  ASSERT_TRUE(cuda::q_map_shape(dense, 128, 4, 128, &q, &why)) << why;
  EXPECT_EQ(q.dims[0], 128u);
  EXPECT_EQ(q.dims[1], 32u);
  EXPECT_EQ(q.dims[2], 1000u);
  EXPECT_EQ(q.strides[0], 256u);
  EXPECT_EQ(q.strides[1], 8192u);
  EXPECT_EQ(q.box[0], 64u);
  EXPECT_EQ(q.box[1], 4u);
  EXPECT_EQ(q.box[2], 32u);
  // The query part of a fused QKV projection: strided tokens are fine.
  TensorView fused = dense;
  fused.strides[0] = 3 * 32 * 128;
  ASSERT_TRUE(cuda::q_map_shape(fused, 128, 4, 128, &q, &why)) << why;
  EXPECT_EQ(q.strides[1], 3u * 8192u);
  // MHA (a group of 1): 128 tokens per box.
  ASSERT_TRUE(cuda::q_map_shape(dense, 128, 1, 128, &q, &why)) << why;
  EXPECT_EQ(q.box[1], 1u);
  EXPECT_EQ(q.box[2], 128u);
  // Refused, each with its reason: a group of 7 (28 / 4 heads), fewer tokens than a box, a
  // base or a row stride off 16 bytes, non-contiguous rows, a 32-bit query.
  auto refused = [&](const TensorView& v, int head_size, int group, const char* reason) {
    EXPECT_FALSE(cuda::q_map_shape(v, head_size, group, 128, &q, &why)) << reason;
    EXPECT_NE(std::string(why).find(reason), std::string::npos) << why;
  };
  refused(TensorView::contiguous(base, DType::kBF16, {1000, 28, 128}), 128, 7, "group");
  refused(TensorView::contiguous(base, DType::kBF16, {31, 32, 128}), 128, 4, "tokens");
  TensorView shifted = dense;
  shifted.data = static_cast<char*>(base) + 2;
  refused(shifted, 128, 4, "16 bytes");
  refused(TensorView::contiguous(base, DType::kBF16, {1000, 32, 68}), 68, 4, "16 bytes");
  TensorView columns = dense;
  columns.strides[2] = 2;
  refused(columns, 128, 4, "contiguous");
  refused(TensorView::contiguous(base, DType::kF32, {1000, 32, 128}), 128, 4, "16-bit");
}

// Options by name (Registry::configure's parser): every word and integer each one takes, the
// values spelled back as they were set, and errors that name the option, the value and what is
// allowed, leaving the options unchanged.
// Which devices run the Hopper code: 9.0 alone, and only where the build has it; the portable
// kernels serve the rest from Ampere on. The prefill table follows: without Hopper code (or
// asked for "8"), the portable kernel; with it, on 9.0, the wgmma one.
TEST(CudaBackendHost, HopperCodeRunsOnComputeCapability90WhereCompiled) {
  EXPECT_TRUE(cuda::runs_hopper_code(9, 0, true));
  EXPECT_FALSE(cuda::runs_hopper_code(9, 0, false));
  EXPECT_FALSE(cuda::runs_hopper_code(8, 0, true));
  EXPECT_FALSE(cuda::runs_hopper_code(8, 9, true));
  EXPECT_FALSE(cuda::runs_hopper_code(10, 0, true));
  EXPECT_FALSE(cuda::runs_hopper_code(12, 0, true));
  EXPECT_EQ(cuda::kMinCcMajor, 8);
  const cuda::prefill::PrefillKernel* portable =
      cuda::prefill::find_prefill(DType::kBF16, DType::kBF16, 128, 8, false, false);
  ASSERT_NE(portable, nullptr);
  EXPECT_EQ(portable->sm, 80);
  const cuda::prefill::PrefillKernel* hopper =
      cuda::prefill::find_prefill(DType::kBF16, DType::kBF16, 128, 9, false, false);
  ASSERT_NE(hopper, nullptr);
  EXPECT_EQ(hopper->sm, cuda::hopper_code_compiled() ? 90 : 80);
  // The MLA latent kernels are Hopper code: compiled exactly where it is.
  EXPECT_EQ(cuda::mla::mla_kernels().empty(), !cuda::hopper_code_compiled());
}

TEST(CudaBackendHost, OptionsByName) {
  const cuda::BackendOptions d;
  EXPECT_EQ(d.prefill_persistent, cuda::kPrefillPersistent);
  EXPECT_EQ(d.prefill_pair_group, 0);
  EXPECT_TRUE(d.prefill_dynamic);
  EXPECT_TRUE(d.prefill_tma);
  const std::vector<BackendOptionInfo> infos = cuda::describe_options(d);
  for (size_t n = 0; n < infos.size(); ++n) {
    const BackendOptionInfo& i = infos[n];
    EXPECT_EQ(i.value,
              i.name == "checked" || i.name == "head_scales" || i.name == "v_head" ? "off" : "auto")
        << i.name;
    EXPECT_FALSE(i.help.empty()) << i.name;
    // Each word it lists is accepted and spells back as itself.
    for (const std::string& a : i.allowed) {
      if (a.rfind("an integer", 0) == 0) continue;
      EXPECT_EQ(cuda::describe_options(cuda::apply_settings(d, {i.name + "=" + a}))[n].value, a)
          << i.name;
    }
  }
  auto with = [&](std::vector<std::string> settings) { return cuda::apply_settings(d, settings); };
  const int max = std::numeric_limits<int>::max();
  EXPECT_EQ(with({"prefill_persistent=1"}).prefill_persistent, 1);
  EXPECT_EQ(with({"prefill_persistent=264"}).prefill_persistent, 264);
  EXPECT_EQ(with({"prefill_persistent=1", "prefill_persistent=auto"}).prefill_persistent, max);
  EXPECT_EQ(with({"prefill_pair_group=3"}).prefill_pair_group, 3);
  EXPECT_EQ(with({"prefill_pair_group=auto"}).prefill_pair_group, 0);
  EXPECT_FALSE(with({"prefill_walk=static"}).prefill_dynamic);
  EXPECT_FALSE(with({"prefill_copy=cp.async"}).prefill_tma);
  EXPECT_TRUE(with({"kernels=portable"}).portable);
  EXPECT_FALSE(with({"kernels=portable", "kernels=auto"}).portable);
  EXPECT_EQ(with({"prefill=all"}).prefill, cuda::PrefillRoute::kAll);
  EXPECT_EQ(with({"prefill=off"}).prefill, cuda::PrefillRoute::kOff);
  EXPECT_TRUE(with({"prefill_kernel=portable"}).portable_prefill);
  EXPECT_EQ(with({"decode_copy=bulk"}).decode_copy, cuda::DecodeCopy::kBulk);
  EXPECT_EQ(with({"decode_copy=cp.async"}).decode_copy, cuda::DecodeCopy::kCpAsync);
  EXPECT_EQ(with({"mla_copy=cp.async"}).mla_copy, cuda::MlaCopy::kCpAsync);
  EXPECT_TRUE(with({"checked=on"}).checked);
  EXPECT_EQ(with({"splits=64"}).num_splits, 64);
  EXPECT_EQ(with({"splits=5", "splits=auto"}).num_splits, 0);
  const cuda::BackendOptions two = with({"prefill=all", "prefill_persistent=2"});
  EXPECT_EQ(two.prefill, cuda::PrefillRoute::kAll);
  EXPECT_EQ(two.prefill_persistent, 2);
  // Bad values: the option, the value and what it allows.
  EXPECT_ERROR(with({"prefill_persistent=0"}), InvalidArgument,
               "cuda backend option 'prefill_persistent': '0' is not auto or an integer >= 1");
  for (const char* bad : {"-2", "yes", "4x", " 3", "off", ""}) {
    EXPECT_ERROR(with({std::string("prefill_persistent=") + bad}), InvalidArgument,
                 std::string("'prefill_persistent': '") + bad + "'");
  }
  EXPECT_ERROR(with({"splits=65"}), InvalidArgument,
               "'splits': '65' is not auto or an integer in [1, 64]");
  EXPECT_ERROR(with({"prefill_pair_group=all"}), InvalidArgument, "'prefill_pair_group': 'all'");
  EXPECT_ERROR(with({"prefill_walk=dynamic"}), InvalidArgument,
               "'prefill_walk': 'dynamic' is not auto or static");
  EXPECT_ERROR(with({"prefill=All"}), InvalidArgument, "'prefill': 'All' is not auto, off or all");
  // Unknown names list the options; a setting without '=' is named.
  EXPECT_ERROR(with({"pingpong_min_tiles=2"}), InvalidArgument,
               "cuda backend has no option 'pingpong_min_tiles'; its options: checked, splits,");
  EXPECT_ERROR(with({"prefill"}), InvalidArgument, "'prefill' is not a setting of the form");
  EXPECT_ERROR(with({"=all"}), InvalidArgument, "'=all' is not a setting of the form");
}

// The registered backend replaced through Registry::configure: the new options are what it
// lists, a bad setting changes nothing, and the old backend stays usable.
TEST(CudaBackendHost, RegistryConfigure) {
  Registry r;
  r.add(cuda::make_backend(cuda::BackendOptions{}));
  r.add(ref::make_backend());
  const Backend* before = r.find("cuda");
  r.configure("cuda", {"prefill=all", "prefill_persistent=1"});
  const Backend* after = r.find("cuda");
  ASSERT_NE(after, nullptr);
  EXPECT_NE(after, before);
  EXPECT_EQ(r.backends().front(), after);  // the same place in the priority order
  auto value = [](const Backend& b, std::string_view name) {
    for (const BackendOptionInfo& i : b.options()) {
      if (i.name == name) return i.value;
    }
    return std::string("?");
  };
  EXPECT_EQ(value(*after, "prefill"), "all");
  EXPECT_EQ(value(*after, "prefill_persistent"), "1");
  EXPECT_EQ(value(*before, "prefill"), "auto");  // still alive, still its own options
  // Settings apply over the current ones.
  r.configure("cuda", {"prefill_persistent=auto"});
  EXPECT_EQ(value(*r.find("cuda"), "prefill"), "all");
  EXPECT_EQ(value(*r.find("cuda"), "prefill_persistent"), "auto");
  const Backend* kept = r.find("cuda");
  EXPECT_ERROR(r.configure("cuda", {"prefill=auto", "mla_consumer=redundant"}), InvalidArgument,
               "'mla_consumer': 'redundant' is not auto, split-s, seesaw, swap-ab or swap-ab-32");
  EXPECT_EQ(r.find("cuda"), kept);
  EXPECT_EQ(value(*kept, "prefill"), "all");
  EXPECT_ERROR(r.configure("ref", {"x=1"}), InvalidArgument, "backend 'ref' has no options");
  EXPECT_ERROR(r.configure("tpu", {"x=1"}), InvalidArgument, "'tpu' is not a registered backend");
}

// The environment holds only the split count and checked mode.
TEST(CudaBackendHost, SplitsFromTheEnvironment) {
  const char* name = cuda::kSplitsEnvVar;
  const char* was = std::getenv(name);
  const std::string saved = was ? was : "";
  setenv(name, "7", 1);
  EXPECT_EQ(cuda::backend_options_from_env().num_splits, 7);
  setenv(name, "0", 1);
  EXPECT_ERROR(cuda::backend_options_from_env(), InvalidArgument,
               "PAGEDATTN_CUDA_SPLITS: cuda backend option 'splits': '0' is not auto or an "
               "integer in [1, 64]");
  unsetenv(name);
  EXPECT_EQ(cuda::backend_options_from_env().num_splits, 0);
  if (was) setenv(name, saved.c_str(), 1);
}

// The MLA route: the option's spellings, and what auto means per cache kind and head count
// (the seesaw where a request's rows span two M tiles on a 16-bit cache, split-S elsewhere; no
// seesaw over fp8, which has one 16-bit stage).
TEST(CudaBackendHost, MlaRouteByOptionAndHeadCount) {
  if (!cuda::hopper_code_compiled()) {
    GTEST_SKIP()
        << "the MLA latent kernels are Hopper code, not in this build (PAGEDATTN_CUDA_ARCHS "
           "without 90a)";
  }
  using cuda::mla::Consumer;
  const cuda::BackendOptions d;
  EXPECT_EQ(d.mla_consumer, Consumer::kAuto);
  const std::pair<const char*, Consumer> spellings[] = {{"auto", Consumer::kAuto},
                                                        {"split-s", Consumer::kSplitS},
                                                        {"seesaw", Consumer::kSeesaw},
                                                        {"swap-ab", Consumer::kSwapAB},
                                                        {"swap-ab-32", Consumer::kSwapAB32}};
  for (const auto& [text, want] : spellings) {
    EXPECT_EQ(cuda::apply_settings(d, {std::string("mla_consumer=") + text}).mla_consumer, want)
        << text;
    EXPECT_STREQ(cuda::mla::consumer_name(want), text);
  }
  for (const char* bad : {"split_s", "Seesaw", "fast", "redundant"}) {
    EXPECT_ERROR(cuda::apply_settings(d, {std::string("mla_consumer=") + bad}), InvalidArgument,
                 "'mla_consumer'");
  }
  // The columns each CTA of an s-CTA cluster owns cover the 512 latent columns in multiples of 4.
  for (int s = 2; s <= cuda::mla::kMaxClusterSplits; ++s) {
    const int cpc = cuda::mla::merge_cols(s);
    EXPECT_EQ(cpc % 4, 0) << s;
    EXPECT_GE(s * cpc, cuda::mla::kLatent) << s;
    EXPECT_LT((s - 1) * cpc, cuda::mla::kLatent) << s;  // every CTA owns some
  }

  for (DType act : {DType::kBF16, DType::kF16}) {
    const cuda::mla::MlaKernel* k = cuda::mla::find_mla(act, act, 128);
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->consumer, Consumer::kSeesaw);
    for (DType cache : {act, DType::kFp8E4M3}) {
      for (int heads : {16, 64, 128}) {
        if (heads == 128 && cache == act) continue;  // the seesaw, above
        // Split-S: the 512-column instance (no P k_pe; splits merged in a cluster) for the
        // latent output, the 576-column one (combine kernel) for the generic contract.
        k = cuda::mla::find_mla(act, cache, heads);
        ASSERT_NE(k, nullptr);
        EXPECT_EQ(k->consumer, Consumer::kSplitS) << heads;
        EXPECT_EQ(k->max_out_cols, cuda::mla::kLatent);
        EXPECT_EQ(k->block_m, 64);
        EXPECT_TRUE(k->cluster_merge);
        const cuda::mla::MlaKernel* wide =
            cuda::mla::find_mla(act, cache, heads, Consumer::kSplitS, cuda::mla::kEntry);
        ASSERT_NE(wide, nullptr);
        EXPECT_NE(wide, k);
        EXPECT_EQ(wide->consumer, Consumer::kSplitS);
        EXPECT_EQ(wide->max_out_cols, cuda::mla::kEntry);
        EXPECT_FALSE(wide->cluster_merge);
        // Asked for a narrower output, still the narrowest that holds it.
        EXPECT_EQ(cuda::mla::find_mla(act, cache, heads, Consumer::kSplitS, 301), k);
        EXPECT_EQ(cuda::mla::find_mla(act, cache, heads, Consumer::kSplitS, 513), wide);
      }
    }
    EXPECT_EQ(cuda::mla::find_mla(act, act, 128, Consumer::kSeesaw, cuda::mla::kEntry), nullptr);
    EXPECT_EQ(cuda::mla::find_mla(act, act, 16, Consumer::kSwapAB, cuda::mla::kEntry), nullptr);
    EXPECT_EQ(cuda::mla::find_mla(act, DType::kFp8E4M3, 128, Consumer::kSeesaw), nullptr);
    // Swap AB: 16- and 32-row CTAs over either cache kind, the 512 latent columns; their splits
    // merge in a cluster.
    for (DType cache : {act, DType::kFp8E4M3}) {
      k = cuda::mla::find_mla(act, cache, 16, Consumer::kSwapAB);
      ASSERT_NE(k, nullptr);
      EXPECT_EQ(k->block_m, 16);
      EXPECT_EQ(k->max_out_cols, cuda::mla::kLatent);
      EXPECT_TRUE(k->cluster_merge);
      k = cuda::mla::find_mla(act, cache, 16, Consumer::kSwapAB32);
      ASSERT_NE(k, nullptr);
      EXPECT_EQ(k->block_m, 32);
      EXPECT_EQ(k->max_out_cols, cuda::mla::kLatent);
      EXPECT_TRUE(k->cluster_merge);
    }
  }
  EXPECT_EQ(cuda::mla::find_mla(DType::kF32, DType::kF32, 128), nullptr);
  EXPECT_EQ(cuda::mla::find_mla(DType::kBF16, DType::kF16, 16), nullptr);
}

// Per step: swap AB (auto's narrow kernels) only where every request's rows fit its 16- or 32-row
// CTA (the narrowest that does) and the output is the latent width; the configured kernel where
// the output fits it; auto's wide kernel for the rest; nothing where none fits (the forward's
// NotSupported).
TEST(CudaBackendHost, MlaKernelPerStep) {
  if (!cuda::hopper_code_compiled()) {
    GTEST_SKIP()
        << "the MLA latent kernels are Hopper code, not in this build (PAGEDATTN_CUDA_ARCHS "
           "without 90a)";
  }
  using cuda::mla::Consumer;
  using cuda::mla::mla_for_step;
  using cuda::mla::NarrowMla;
  const cuda::mla::MlaKernel* split = cuda::mla::find_mla(DType::kBF16, DType::kBF16, 16);
  const cuda::mla::MlaKernel* split576 =
      cuda::mla::find_mla(DType::kBF16, DType::kBF16, 16, Consumer::kSplitS, cuda::mla::kEntry);
  const cuda::mla::MlaKernel* swap =
      cuda::mla::find_mla(DType::kBF16, DType::kBF16, 16, Consumer::kSwapAB);
  const cuda::mla::MlaKernel* swap32 =
      cuda::mla::find_mla(DType::kBF16, DType::kBF16, 16, Consumer::kSwapAB32);
  const cuda::mla::MlaKernel* seesaw = cuda::mla::find_mla(DType::kBF16, DType::kBF16, 128);
  ASSERT_NE(split, nullptr);
  ASSERT_NE(split576, nullptr);
  ASSERT_NE(swap, nullptr);
  ASSERT_NE(swap32, nullptr);
  ASSERT_NE(seesaw, nullptr);
  const NarrowMla both = {swap, swap32};
  // 16 heads: one token a request fits swap AB, two its 32-row CTAs; three do not; 576
  // columns do not (auto's wide kernel, split-S's 576-column instance, takes them).
  EXPECT_EQ(mla_for_step(split, split576, both, 1, 16, 512), swap);
  EXPECT_EQ(mla_for_step(split, split576, both, 1, 16, 301), swap);
  EXPECT_EQ(mla_for_step(split, split576, both, 2, 16, 512), swap32);
  EXPECT_EQ(mla_for_step(split, split576, both, 3, 16, 512), split);
  EXPECT_EQ(mla_for_step(split, split576, both, 1, 16, 576), split576);
  EXPECT_EQ(mla_for_step(split, split576, both, 2, 16, 576), split576);
  EXPECT_EQ(mla_for_step(split, split576, both, 4, 16, 576), split576);
  EXPECT_EQ(mla_for_step(split, split576, both, 4, 4, 512), swap);     // 16 rows
  EXPECT_EQ(mla_for_step(split, split576, both, 1, 32, 512), swap32);  // 32 rows
  EXPECT_EQ(mla_for_step(split, split576, both, 1, 33, 512), split);
  // Only one of them compiled (or asked for): the other is skipped.
  EXPECT_EQ(mla_for_step(split, nullptr, NarrowMla{nullptr, swap32}, 1, 16, 512), swap32);
  EXPECT_EQ(mla_for_step(split, nullptr, NarrowMla{swap, nullptr}, 2, 16, 512), split);
  // A forced kernel (no narrow, no wide): itself where the output fits, else nothing.
  EXPECT_EQ(mla_for_step(swap, nullptr, {}, 1, 16, 512), swap);
  EXPECT_EQ(mla_for_step(swap, nullptr, {}, 2, 16, 512), swap);
  EXPECT_EQ(mla_for_step(swap, nullptr, {}, 1, 16, 576), nullptr);
  EXPECT_EQ(mla_for_step(swap32, nullptr, {}, 4, 16, 512), swap32);
  // 128 heads under auto: the seesaw, split-S for 576 columns.
  EXPECT_EQ(mla_for_step(seesaw, split576, both, 1, 128, 512), seesaw);
  EXPECT_EQ(mla_for_step(seesaw, split576, both, 1, 128, 576), split576);
  // split-s forced: its 512-column instance, the 576-column one as the wide kernel.
  EXPECT_EQ(mla_for_step(split, split576, {}, 1, 16, 512), split);
  EXPECT_EQ(mla_for_step(split, split576, {}, 1, 16, 576), split576);
}

// fp8 swap AB builds its wgmma A fragments from the raw tile (frags_fp8.cuh): the orders it
// sums in must be permutations that the producer's Q copy, the P^T writer and the epilogue
// share, and the raw chunk swizzle must keep both fragment loads free of bank conflicts.
TEST(CudaBackendHost, MlaFp8FragmentOrdersArePermutationsWithoutBankConflicts) {
  using namespace cuda::mla;
  std::vector<int> q(64, 0), pc(64, 0), oc(kLatent, 0);
  for (int col = 0; col < 64; ++col) {
    ASSERT_GE(q_column(col), 0);
    ASSERT_LT(q_column(col), 64);
    ++q[size_t(q_column(col))];
    // Lane t's 16 columns of a group (one 16-byte chunk of the key) are its fragment k's.
    EXPECT_EQ((q_column(col) >> 1) & 3, col >> 4) << col;
  }
  // The producer's 16-byte chunk m of a Q panel row: columns 16 t + 2 m + {0, 1}, t = 0..3.
  for (int m = 0; m < 8; ++m) {
    for (int t = 0; t < 4; ++t) {
      for (int e = 0; e < 2; ++e) EXPECT_EQ(q_column(16 * t + 2 * m + e), 8 * m + 2 * t + e);
    }
  }
  for (int key = 0; key < kBlockN; ++key) ++pc[size_t(p_column(key))];
  // O^T's k: lane t4 reads keys 16 kk + 4 j + t4 for its logical k 16 kk + 8 h + 2 t4 + e.
  for (int kk = 0; kk < 4; ++kk) {
    for (int t4 = 0; t4 < 4; ++t4) {
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(p_column(16 * kk + 4 * j + t4), 16 * kk + 8 * (j >> 1) + 2 * t4 + (j & 1));
      }
    }
  }
  for (int cw = 0; cw < 2; ++cw) {
    for (int w = 0; w < 4; ++w) {
      for (int g = 0; g < 8; ++g) {
        for (int n = 0; n < 4; ++n) {
          for (int h8 = 0; h8 < 2; ++h8) {
            const int col = o_column(cw, n, w, g, h8);
            ASSERT_GE(col, 0);
            ASSERT_LT(col, kLatent);
            ++oc[size_t(col)];
            EXPECT_EQ(col - o_column(cw, 0, w, g, 0), 2 * n + h8);  // a thread's 8 are adjacent
          }
        }
      }
    }
  }
  for (int v : q) EXPECT_EQ(v, 1);
  for (int v : pc) EXPECT_EQ(v, 1);
  for (int v : oc) EXPECT_EQ(v, 1);
  // A raw row's 16-byte chunk q of key r at q ^ raw_chunk_swizzle(r); 4-byte banks.
  auto bank = [](int key, int byte) {
    const int chunk = (byte >> 4) ^ raw_chunk_swizzle(key);
    return ((key * kEntry + chunk * 16 + (byte & 15)) >> 2) & 31;
  };
  for (int w = 0; w < 4; ++w) {
    for (int group = 0; group < kPanels; ++group) {
      // K loads, 16 bytes a lane, 8 lanes a phase: keys 16 w + g (g = 2 p, 2 p + 1), chunk t4.
      for (int phase = 0; phase < 4; ++phase) {
        std::vector<int> used(32, 0);
        for (int lane = 8 * phase; lane < 8 * phase + 8; ++lane) {
          const int g = lane >> 2, t4 = lane & 3;
          for (int b = 0; b < 16; b += 4)
            ++used[size_t(bank(16 * w + g, 64 * group + 16 * t4 + b))];
        }
        for (int u : used) EXPECT_EQ(u, 1) << "K loads, warp " << w << " group " << group;
      }
    }
    for (int cw = 0; cw < 2; ++cw) {
      // V loads, 8 bytes a lane, 16 lanes a phase: key 16 kk + 4 j + t4, columns 8 at o_column.
      for (int phase = 0; phase < 2; ++phase) {
        for (int j = 0; j < 4; ++j) {
          std::vector<int> used(32, 0);
          for (int lane = 16 * phase; lane < 16 * phase + 16; ++lane) {
            const int g = lane >> 2, t4 = lane & 3;
            const int col = o_column(cw, 0, w, g, 0);
            for (int b = 0; b < 8; b += 4) ++used[size_t(bank(4 * j + t4, col + b))];
          }
          for (int u : used) EXPECT_EQ(u, 1) << "V loads, warpgroup " << cw << " warp " << w;
        }
      }
    }
  }
}

TEST(CudaBackendHost, PrefillWalkVisitsEveryWorkTileOnceGroupByGroup) {
  for (int pairs : {1, 5, 8, 37}) {
    for (int q_tiles : {1, 3, 32}) {
      for (int group : {0, 1, 3, 8, 36, 37, 1000}) {
        const int size = group > 0 && group < pairs ? group : pairs;
        std::vector<int> seen(size_t(pairs) * size_t(q_tiles), 0);
        int prev_pair0 = -1, prev_rank = -1;
        for (int x = 0; x < pairs * q_tiles; ++x) {
          const cuda::prefill::WalkIndex at = cuda::prefill::walk_index(x, pairs, group, q_tiles);
          ASSERT_GE(at.pair, 0);
          ASSERT_LT(at.pair, pairs);
          ASSERT_GE(at.tile_rank, 0);
          ASSERT_LT(at.tile_rank, q_tiles);
          ++seen[size_t(at.pair) * size_t(q_tiles) + size_t(at.tile_rank)];
          // Groups in order of their first pair; within one, the q tile ranks never go back.
          const int pair0 = at.pair / size * size;
          ASSERT_GE(pair0, prev_pair0) << x;
          if (pair0 == prev_pair0) {
            ASSERT_GE(at.tile_rank, prev_rank) << x;
          }
          prev_pair0 = pair0;
          prev_rank = at.tile_rank;
        }
        for (size_t i = 0; i < seen.size(); ++i) {
          ASSERT_EQ(seen[i], 1) << "pairs " << pairs << " q tiles " << q_tiles << " group " << group
                                << " work tile " << i;
        }
      }
    }
  }
  // One group is the order before groups: the q tile rank slowest, the pair fastest.
  EXPECT_EQ(cuda::prefill::walk_index(13, 5, 0, 4).tile_rank, 2);
  EXPECT_EQ(cuda::prefill::walk_index(13, 5, 0, 4).pair, 3);
  // Groups of 2 over 5 pairs and 4 q tiles: pairs {0, 1} (x 0-7), {2, 3} (8-15), {4} (16-19).
  EXPECT_EQ(cuda::prefill::walk_index(9, 5, 2, 4).pair, 3);
  EXPECT_EQ(cuda::prefill::walk_index(9, 5, 2, 4).tile_rank, 0);
  EXPECT_EQ(cuda::prefill::walk_index(18, 5, 2, 4).pair, 4);
  EXPECT_EQ(cuda::prefill::walk_index(18, 5, 2, 4).tile_rank, 2);
}

// The dynamic walk (draw_tile): CTAs drawing from one counter in random interleavings take every
// work tile with rows exactly once, none without, each in order of the numbering, and the counter
// is 0 again after the launch's last draw (so that the next launch, or graph replay, starts
// over).
TEST(CudaBackendHost, DynamicWalkTakesEveryWorkTileOnceAndResetsTheCounter) {
  std::mt19937 rng(11);
  for (int total : {2, 3, 7, 64, 1000}) {
    for (int ctas : {1, 2, 5, 132}) {
      if (ctas >= total) continue;  // the kernel walks dynamically only with fewer CTAs
      for (int trial = 0; trial < 3; ++trial) {
        const size_t n = static_cast<size_t>(total), m = static_cast<size_t>(ctas);
        std::vector<char> rows(n);
        for (char& r : rows) r = char(rng() % 4 != 0);
        int counter = 0, resets = 0;
        std::vector<int> first(m), last(m, -1), seen(n, 0);
        std::vector<char> done(m, 0);
        for (int b = 0; b < ctas; ++b) first[size_t(b)] = b;
        int live = ctas;
        while (live > 0) {
          const int b = int(rng() % unsigned(ctas));
          if (done[size_t(b)]) continue;
          int t;  // as the kernel walks: numbers without rows dropped, the next drawn
          do {
            t = cuda::prefill::draw_tile(
                first[size_t(b)], ctas, total, [&] { return counter++; },
                [&] {
                  counter = 0;
                  ++resets;
                });
          } while (t >= 0 && !rows[size_t(t)]);
          if (t < 0) {
            done[size_t(b)] = 1;
            --live;
            continue;
          }
          ASSERT_LT(t, total);
          ASSERT_GT(t, last[size_t(b)]) << "a CTA's work tiles follow the numbering";
          last[size_t(b)] = t;
          ++seen[size_t(t)];
        }
        for (int x = 0; x < total; ++x) {
          ASSERT_EQ(seen[size_t(x)], rows[size_t(x)] ? 1 : 0)
              << "total " << total << " ctas " << ctas << " work tile " << x;
        }
        EXPECT_EQ(counter, 0) << "total " << total << " ctas " << ctas;
        EXPECT_EQ(resets, 1) << "total " << total << " ctas " << ctas;
      }
    }
  }
}

TEST(CudaBackendHost, DynamicWalkOnlyWhereMostWorkTilesHaveRows) {
  // Four prompts of 4000 tokens, GQA 32/8: 125 q tiles each, every one with rows.
  EXPECT_TRUE(cuda::prefill::dynamic_walk_pays(16000, 4, 4, 128, 125));
  // One 4096-token prompt beside 100 decode requests: a grid of 128 q tiles x 101 requests per
  // KV head, of which at most 233 have rows.
  EXPECT_FALSE(cuda::prefill::dynamic_walk_pays(4196, 101, 4, 128, 128));
  // Lengths 3000 / 512 / 700 / 1500: 183 of 376 at most, just under half.
  EXPECT_FALSE(cuda::prefill::dynamic_walk_pays(5712, 4, 4, 128, 94));
  EXPECT_TRUE(cuda::prefill::dynamic_walk_pays(5712 + 400, 4, 4, 128, 94));
}

// ---- GPU: every kernel against the reference -----------------------------------------------

backend_ops::OpCase make_case(std::string name, AttentionConfig c,
                              std::vector<backend_ops::RequestShape> requests, int pad = 0,
                              uint32_t seed = 7) {
  backend_ops::OpCase k;
  k.config = c;
  k.requests = std::move(requests);
  k.pad_tokens = pad;
  if (is_fp8(c.kv_cache_dtype)) {
    k.k_scale = 0.75f;
    k.v_scale = 1.5f;
  }
  k.seed = seed;
  k.name = std::move(name);
  return k;
}

std::vector<backend_ops::OpCase> decode_cases() {
  std::vector<backend_ops::OpCase> cases;
  AttentionConfig c = gqa_config();
  cases.push_back(
      make_case("gqa long decode + spec decode", c, {{3000, 1}, {5000, 1}, {700, 1}, {2000, 4}}));
  {
    AttentionConfig x = gqa_config(DType::kBF16, 128);
    x.num_heads = 16;
    x.num_kv_heads = 2;  // G = 8: 16 tokens are 128 rows, 8 q tiles
    x.sliding_window = 100;
    x.sinks = std::vector<float>(16, 0.5f);
    for (int h = 0; h < 16; ++h) x.sinks[size_t(h)] = 0.25f * float(h % 5) - 0.5f;
    x.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    x.kv_cache_layout = KVCacheLayout::kHND;
    cases.push_back(make_case("spec decode 16 tokens window sinks fp8 HND", x,
                              {{900, 16}, {40, 16}, {0, 3}}, 2));
  }
  {
    AttentionConfig x = gqa_config(DType::kF16, 80);
    x.num_heads = 16;
    x.num_kv_heads = 1;  // MQA
    x.alibi_slopes = alibi_slopes(16);
    x.logits_soft_cap = 30.0f;
    x.block_size = 1;
    cases.push_back(make_case("mqa d80 f16 alibi softcap bs1", x, {{1200, 7}, {33, 1}}));
  }
  {
    AttentionConfig x = gqa_config(DType::kF32, 96);
    x.kv_cache_dtype = KVCacheDType::kFp8E5M2;
    x.block_size = 3;
    cases.push_back(make_case("f32 generic d96 e5m2 bs3", x, {{777, 1}, {64, 5}}));
  }
  {
    AttentionConfig x = gqa_config(DType::kBF16, 48);
    x.kv_cache_dtype = KVCacheDType::kFloat32;
    cases.push_back(make_case("bf16 over f32 cache d48 (generic)", x, {{500, 2}, {17, 1}}));
  }
  {
    AttentionConfig x = gqa_config(DType::kBF16, 256);
    x.block_size = 256;
    cases.push_back(make_case("chunked prefill d256 bs256", x, {{500, 300}, {0, 40}}));
  }
  {
    AttentionConfig x = gqa_config(DType::kF16, 192);
    x.num_kv_heads = 32;  // MHA
    x.block_size = 128;
    x.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    cases.push_back(make_case("mha d192 fp8 bs128", x, {{2500, 1}, {100, 2}}));
  }
  {
    AttentionConfig x = gqa_config(DType::kBF16, 64);
    x.attn_type = AttentionType::kEncoderOnly;
    x.sliding_window = 9;
    x.alibi_slopes = alibi_slopes(32);
    cases.push_back(make_case("encoder_only window alibi", x, {{0, 40}, {0, 1}, {0, 77}}));
    x.attn_type = AttentionType::kEncoder;
    x.dtype = DType::kF32;
    x.alibi_slopes.clear();
    cases.push_back(make_case("encoder f32", x, {{0, 19}, {0, 50}}));
  }
  {
    AttentionConfig x = gqa_config(DType::kBF16, 64);
    x.attn_type = AttentionType::kEncoderDecoder;
    x.kv_cache_dtype = KVCacheDType::kFp8E4M3;
    cases.push_back(make_case("cross fp8", x, {{0, 3, 0, 300, true}, {0, 1, 0, 300, false}}));
  }
  return cases;
}

TEST(CudaDecode, MatchesTheReferenceAtEverySplitCount) {
  REQUIRE_GPU();
  for (int splits : {0, 1, 2, 5, 64}) {  // 0 = the planner's choice
    const auto backend = cuda::make_backend({false, splits});
    for (const auto& k : decode_cases()) {
      const backend_ops::CaseResult r = backend_ops::run_case(*backend, k, {Device::cuda(0), 0});
      EXPECT_TRUE(r.supported) << k.name << ": " << r.message;
      EXPECT_TRUE(r.passed) << k.name << " (splits " << splits << "): " << r.message << "\n  out "
                            << r.output_error.to_string() << " budget " << r.output_budget.max_abs
                            << "\n  lse " << r.lse_error.to_string() << " budget "
                            << r.lse_budget.max_abs;
    }
  }
}

TEST(CudaDecode, TheWholeBackendOpsMatrixPasses) {
  REQUIRE_GPU();
  const auto backend = cuda::make_backend({false, 0});
  int passed = 0;
  for (const auto& k : backend_ops::make_case_matrix(20261202)) {
    const backend_ops::CaseResult r = backend_ops::run_case(*backend, k, {Device::cuda(0), 0});
    if (!r.supported) continue;
    EXPECT_TRUE(r.passed) << k.name << ": " << r.message;
    passed += r.passed;
  }
  EXPECT_GT(passed, 50);
}

// With one visible key the output row is v_scale * V and the LSE is scale * k_scale * q.k, so
// every code of an fp8 cache must widen to its exact value through the tensor-core kernels (in
// registers, or in smem at head size 80): a flushed subnormal or a byte routed to the wrong
// lane or column shows as a wrong element. Request r's key holds code r in every K dim (its
// query is one-hot at a dim that moves with r and the head) and code r + j in V dim j; codes
// without a finite value (e4m3 NaN, e5m2 inf / NaN) are replaced by 0. On the decode kernel,
// then with every row on the prefill kernels (Hopper's widens to f16 in its producer; the
// portable one in shared memory). The prefill kernels' exponent, one FMA (s f - round(max f)),
// leaves the visible key's P at 2^(+-ulp / 2 of s f), not 1: at e5m2's largest scores (~4e4)
// 1 +- 7e-4, rounded to 16 bits for P V while l keeps it in float, so their outputs may be
// one ulp of the output type off (2^-10 relative for f16, 2^-7 for bf16); the nearest other
// code is >= 2^-4 away.
TEST(CudaDecode, EveryFp8CodeWidensExactly) {
  REQUIRE_GPU();
  constexpr int kRequests = 256, kHeads = 4;
  for (int route = 0; route < 3; ++route) {
    cuda::BackendOptions options{false, 1};
    if (route > 0) options.prefill = cuda::PrefillRoute::kAll;
    options.portable_prefill = route == 2;
    const char* const route_name = route == 0 ? "decode" : route == 1 ? "prefill" : "portable";
    const auto backend = cuda::make_backend(options);
    for (DType act : {DType::kBF16, DType::kF16}) {
      for (KVCacheDType kv : {KVCacheDType::kFp8E4M3, KVCacheDType::kFp8E5M2}) {
        for (int d : cuda::decode::compiled_head_sizes(act, cuda::attn::KVKind::kFp8)) {
          AttentionConfig c;
          c.num_heads = kHeads;
          c.num_kv_heads = 1;
          c.head_size = d;
          c.scale = 0.5f;
          c.dtype = act;
          c.kv_cache_dtype = kv;
          c.block_size = 16;
          const DType cd = c.cache_dtype();
          auto value = [&](int code) {
            return double(cd == DType::kFp8E4M3 ? fp8_e4m3_to_float(uint8_t(code))
                                                : fp8_e5m2_to_float(uint8_t(code)));
          };
          auto finite_code = [&](int code) { return std::isfinite(value(code)) ? code : 0; };
          KVCache host = KVCache::allocate(c, kRequests + 1);
          std::memset(host.storage().data(), 0, host.storage().view().nbytes());
          const KVCacheView hv = host.view();
          MetadataBuilder b(c.block_size);
          for (int r = 0; r < kRequests; ++r) {
            const int64_t block = r + 1;
            auto* k = static_cast<uint8_t*>(hv.key.data) + block * hv.key.stride(0);
            auto* v = static_cast<uint8_t*>(hv.value.data) + block * hv.value.stride(0);
            for (int j = 0; j < d; ++j) {
              k[j] = uint8_t(finite_code(r));
              v[j] = uint8_t(finite_code((r + j) % 256));
            }
            b.add(RequestSpec{0, 1, {int32_t(block)}});
          }
          StepMetadata step = b.build();
          const AttentionMetadata md = step.to_device(Device::cuda(0));
          Tensor q_host = Tensor::empty({kRequests, kHeads, d}, act);
          for (int64_t i = 0; i < q_host.view().numel(); ++i)
            store_element(q_host.data(), act, i, 0);
          for (int r = 0; r < kRequests; ++r) {
            for (int h = 0; h < kHeads; ++h) {
              store_element(q_host.data(), act, (int64_t(r) * kHeads + h) * d + (r + 5 * h) % d, 1);
            }
          }
          const Tensor cache = Tensor::copy_of(host.storage().view(), Device::cuda(0));
          const Tensor q = Tensor::copy_of(q_host.view(), Device::cuda(0));
          Tensor out = Tensor::empty({kRequests, kHeads, d}, act, Device::cuda(0));
          Tensor lse = Tensor::empty({kHeads, kRequests}, DType::kF32, Device::cuda(0));
          const auto plan = backend->plan(md, c);
          ASSERT_EQ(plan->workspace_bytes(), 0u);
          ForwardArgs f;
          f.query = q.view();
          f.kv_cache = KVCacheView::from_combined(cache.view());
          f.metadata = &md;
          f.output = out.view();
          f.lse = lse.view();
          f.plan = plan.get();
          backend->make_impl(c, Device::cuda(0))->forward(f);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const Tensor out_h = Tensor::copy_of(out.view(), Device::cpu());
          const Tensor lse_h = Tensor::copy_of(lse.view(), Device::cpu());
          int wrong_out = 0, wrong_lse = 0;
          std::string first;  // the first wrong element, for the message
          for (int r = 0; r < kRequests; ++r) {
            for (int h = 0; h < kHeads; ++h) {
              const double want_lse = 0.5 * value(finite_code(r));
              const double got_lse =
                  load_element(lse_h.data(), DType::kF32, int64_t(h) * kRequests + r);
              wrong_lse += std::abs(got_lse - want_lse) > 1e-6 * std::abs(want_lse);
              for (int j = 0; j < d; ++j) {
                const double got =
                    load_element(out_h.data(), act, (int64_t(r) * kHeads + h) * d + j);
                const double want = value(finite_code((r + j) % 256));
                const double ulp = act == DType::kBF16 ? 0x1p-7 : 0x1p-10;
                const double tol = route == 0 ? 0.0 : ulp * std::abs(want);
                if (std::abs(got - want) > tol && wrong_out++ == 0) {
                  first = detail::cat("request ", r, " head ", h, " dim ", j, ": ", got,
                                      " instead of ", want);
                }
              }
            }
          }
          EXPECT_EQ(wrong_out, 0) << route_name << ": " << dtype_name(act) << " over "
                                  << to_string(kv) << " d" << d << ", first: " << first;
          EXPECT_EQ(wrong_lse, 0) << route_name << ": " << dtype_name(act) << " over "
                                  << to_string(kv) << " d" << d;
        }
      }
    }
  }
}

Tensor random_host(std::vector<int64_t> shape, DType dtype, std::mt19937& rng, float std_dev = 1) {
  Tensor t = Tensor::empty(shape, dtype);
  std::normal_distribution<float> dist(0.0f, std_dev);
  for (int64_t i = 0; i < t.view().numel(); ++i) store_element(t.data(), dtype, i, dist(rng));
  return t;
}

// ---- GPU: write_kv, vectorised and scalar paths ----------------------------------------------

std::string cat_case(const AttentionConfig& c, int64_t misalign) {
  return detail::cat(dtype_name(c.dtype), " into ", to_string(c.kv_cache_dtype), " ",
                     to_string(c.kv_cache_layout), misalign ? " (unaligned views)" : "");
}

// K and V as views into one fused [tokens, width] buffer (as vLLM's QKV projection output),
// starting at column `offset`: an odd offset breaks 16-byte alignment (the scalar path).
TensorView fused_view(const Tensor& buffer, int64_t offset, int heads, int head_size) {
  TensorView v = buffer.view();
  const int64_t width = v.size(1);
  v.data = static_cast<char*>(v.data) + offset * int64_t(dtype_size(v.dtype));
  v.ndim = 3;
  v.shape = {v.size(0), heads, head_size, 0, 0, 0};
  v.strides = {width, head_size, 1, 0, 0, 0};
  return v;
}

TEST(CudaWriteKV, CacheBytesEqualTheReferenceOnBothPaths) {
  REQUIRE_GPU();
  std::mt19937 rng(21);
  const auto ref = ref::make_backend();
  const auto backend = cuda::make_backend({false, 0});
  for (DType act : {DType::kBF16, DType::kF32}) {
    for (KVCacheDType kv : {KVCacheDType::kAuto, KVCacheDType::kFloat16, KVCacheDType::kFloat32,
                            KVCacheDType::kFp8E4M3, KVCacheDType::kFp8E5M2}) {
      for (KVCacheLayout layout : {KVCacheLayout::kNHD, KVCacheLayout::kHND}) {
        for (int64_t misalign : {0, 1}) {
          AttentionConfig c = gqa_config(act, 64);
          c.num_kv_heads = 2;
          c.num_heads = 4;
          c.kv_cache_dtype = kv;
          c.kv_cache_layout = layout;
          const std::string what = cat_case(c, misalign);
          const int64_t tokens = 37, kv_width = int64_t(c.num_kv_heads) * c.head_size;
          const int64_t width = 2 * kv_width + 8 + misalign;
          const Tensor host_buf = random_host({tokens, width}, act, rng, 40.0f);  // fp8 saturates
          const Tensor dev_buf = Tensor::copy_of(host_buf.view(), Device::cuda(0));
          std::vector<int64_t> slots(static_cast<size_t>(tokens));
          for (int64_t t = 0; t < tokens; ++t) slots[size_t(t)] = t % 5 == 3 ? -1 : 7 * t + 3;
          const TensorView host_slots =
              TensorView::contiguous(slots.data(), DType::kI64, {int64_t(slots.size())});
          const Tensor dev_slots = Tensor::copy_of(host_slots, Device::cuda(0));
          KVCache want = KVCache::allocate(c, 20);
          KVCache got = KVCache::allocate(c, 20, Device::cuda(0));
          const KVScales scales{0.75f, 1.5f};
          const int64_t k_off = 8 + misalign, v_off = 8 + misalign + kv_width;
          ref->make_impl(c, Device::cpu())
              ->write_kv({fused_view(host_buf, k_off, c.num_kv_heads, c.head_size),
                          fused_view(host_buf, v_off, c.num_kv_heads, c.head_size),
                          host_slots,
                          want.view(),
                          scales,
                          {}});
          backend->make_impl(c, Device::cuda(0))
              ->write_kv({fused_view(dev_buf, k_off, c.num_kv_heads, c.head_size),
                          fused_view(dev_buf, v_off, c.num_kv_heads, c.head_size),
                          dev_slots.view(),
                          got.view(),
                          scales,
                          {}});
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
          const Tensor back = Tensor::copy_of(got.storage().view(), Device::cpu());
          EXPECT_EQ(std::memcmp(back.data(), want.storage().data(), back.view().nbytes()), 0)
              << what;
        }
      }
    }
  }
}

// Per-KV-head scales (vLLM's reshape_and_cache_flash with k_scale / v_scale of [num_kv_heads]):
// the same bytes as the reference, vectorized (aligned) and element-wise (misaligned), for
// scales that differ by 16x between heads.
TEST(CudaWriteKV, PerHeadScalesGiveTheReferenceBytes) {
  REQUIRE_GPU();
  std::mt19937 rng(22);
  const auto ref = ref::make_backend();
  const auto backend = cuda::make_backend({false, 0});
  for (DType act : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (KVCacheDType kv : {KVCacheDType::kFp8E4M3, KVCacheDType::kFp8E5M2}) {
      for (KVCacheLayout layout : {KVCacheLayout::kNHD, KVCacheLayout::kHND}) {
        for (int64_t misalign : {0, 1}) {
          AttentionConfig c = gqa_config(act, 128);
          c.num_kv_heads = 8;
          c.num_heads = 8;
          c.kv_cache_dtype = kv;
          c.kv_cache_layout = layout;
          const std::string what = cat_case(c, misalign);
          const int64_t tokens = 29, kv_width = int64_t(c.num_kv_heads) * c.head_size;
          const int64_t width = 2 * kv_width + 8 + misalign;
          const Tensor host_buf = random_host({tokens, width}, act, rng, 40.0f);
          const Tensor dev_buf = Tensor::copy_of(host_buf.view(), Device::cuda(0));
          std::vector<int64_t> slots(static_cast<size_t>(tokens));
          for (int64_t t = 0; t < tokens; ++t) slots[size_t(t)] = t % 7 == 2 ? -1 : 5 * t + 1;
          const TensorView host_slots =
              TensorView::contiguous(slots.data(), DType::kI64, {int64_t(slots.size())});
          const Tensor dev_slots = Tensor::copy_of(host_slots, Device::cuda(0));
          KVCache want = KVCache::allocate(c, 12);
          KVCache got = KVCache::allocate(c, 12, Device::cuda(0));
          KVScales scales{0.75f, 1.5f, 1.0f, {}, {}, {}};
          for (int h = 0; h < c.num_kv_heads; ++h) {
            scales.k_scales.push_back(h % 2 ? 0.3f * float(h + 1) : 4.0f / float(h + 1));
            scales.v_scales.push_back(h % 2 ? 2.5f / float(h + 1) : 0.2f * float(h + 1));
          }
          const int64_t k_off = 8 + misalign, v_off = 8 + misalign + kv_width;
          const WriteKVArgs host_args{fused_view(host_buf, k_off, c.num_kv_heads, c.head_size),
                                      fused_view(host_buf, v_off, c.num_kv_heads, c.head_size),
                                      host_slots,
                                      want.view(),
                                      scales,
                                      {}};
          check_write_kv_args(c, host_args);
          ref->make_impl(c, Device::cpu())->write_kv(host_args);
          backend->make_impl(c, Device::cuda(0))
              ->write_kv({fused_view(dev_buf, k_off, c.num_kv_heads, c.head_size),
                          fused_view(dev_buf, v_off, c.num_kv_heads, c.head_size),
                          dev_slots.view(),
                          got.view(),
                          scales,
                          {}});
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
          const Tensor back = Tensor::copy_of(got.storage().view(), Device::cpu());
          EXPECT_EQ(std::memcmp(back.data(), want.storage().data(), back.view().nbytes()), 0)
              << what;
        }
      }
    }
  }
}

// The attention kernels take one scale per call: per-head scales whose values differ are
// refused (NotSupported naming the vector), equal ones collapse to the per-tensor float and pass.
// With the option head_scales=on, k / v scales per KV head (fp8 caches) run on the kernels with
// differing values and match the reference; per-request vectors run where the requests agree
// head by head and are refused where they do not; q scales (the query's quantisation takes one)
// only where all are equal. Without it (the default) differing values are refused.
TEST(CudaDecode, PerHeadScalesRunPerKvHead) {
  REQUIRE_GPU();
  cuda::BackendOptions options;
  options.head_scales = true;
  const auto backend = cuda::make_backend(options);
  const auto default_backend = cuda::make_backend(cuda::BackendOptions{});
  int per_head = 0, per_request_refused = 0, agreeing = 0;
  auto differ = [](const std::vector<float>& v) {
    return std::any_of(v.begin(), v.end(), [&](float x) { return x != v.front(); });
  };
  for (backend_ops::OpCase k : backend_ops::make_case_matrix(20261202)) {
    if (k.k_scales.empty()) continue;
    const size_t heads = size_t(k.config.num_kv_heads);
    bool across_requests = false;
    for (const std::vector<float>* v : {&k.k_scales, &k.v_scales}) {
      for (size_t i = 0; i < v->size(); ++i) across_requests |= (*v)[i] != (*v)[i % heads];
    }
    const bool q_differ = differ(k.q_scales);
    const backend_ops::CaseResult as_is = backend_ops::run_case(*backend, k, {Device::cuda(0), 0});
    const backend_ops::CaseResult off =
        backend_ops::run_case(*default_backend, k, {Device::cuda(0), 0});
    EXPECT_FALSE(off.supported) << k.name;
    EXPECT_NE(off.message.find("scales"), std::string::npos) << k.name << ": " << off.message;
    if (across_requests || q_differ) {
      EXPECT_FALSE(as_is.supported) << k.name;
      EXPECT_NE(as_is.message.find(across_requests ? "differ between requests" : "q_scales"),
                std::string::npos)
          << k.name << ": " << as_is.message;
      per_request_refused += across_requests && !as_is.supported;
    } else if (as_is.supported) {  // else e.g. a head size this build did not compile
      EXPECT_TRUE(as_is.passed) << k.name << ": " << as_is.message;
      per_head += as_is.passed && (differ(k.k_scales) || differ(k.v_scales));
    }
    // Every request given request 0's scales, the q scales one value: served per KV head.
    for (std::vector<float>* v : {&k.k_scales, &k.v_scales}) {
      for (size_t i = 0; i < v->size(); ++i) (*v)[i] = (*v)[i % heads];
    }
    std::fill(k.q_scales.begin(), k.q_scales.end(), 0.02f);
    const backend_ops::CaseResult agree = backend_ops::run_case(*backend, k, {Device::cuda(0), 0});
    if (!agree.supported) continue;
    EXPECT_TRUE(agree.passed) << k.name << ": " << agree.message;
    agreeing += agree.passed;
  }
  EXPECT_GT(per_head, 5);
  EXPECT_GT(per_request_refused, 3);
  EXPECT_GT(agreeing, 10);
}

// ---- GPU: merge_states and amax -------------------------------------------------------------

TEST(CudaMerge, MatchesTheReferenceWithInfinitiesAndGarbage) {
  REQUIRE_GPU();
  const Backend& cuda_backend = *default_registry().find("cuda");
  const auto ref = ref::make_backend();
  std::mt19937 rng(11);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int d : {48, 128, 37}) {
      const int n = 29, h = 6;
      Tensor po = random_host({n, h, d}, dt, rng), so = random_host({n, h, d}, dt, rng);
      Tensor pl = random_host({h, n}, DType::kF32, rng, 3),
             sl = random_host({h, n}, DType::kF32, rng, 3);
      auto* plp = pl.data_as<float>();
      auto* slp = sl.data_as<float>();
      const float inf = std::numeric_limits<float>::infinity();
      for (int i = 0; i < h * n; i += 7) plp[i] = (i % 2) ? inf : -inf;
      for (int i = 3; i < h * n; i += 11) slp[i] = -inf;
      for (int i = 5; i < h * n; i += 13) plp[i] = slp[i] = -inf;  // both empty
      // The side whose weight is 0 may hold garbage: it must never be read.
      for (int i = 0; i < h * n; ++i) {
        const int hh = i / n, t = i % n;
        if (std::isinf(slp[i])) fill_host(so.view().select(0, t).select(0, hh), std::nan(""));
        if (std::isinf(plp[i]) && !std::isinf(slp[i])) {
          fill_host(po.view().select(0, t).select(0, hh), std::nan(""));
        }
      }
      // The oracle merges float64 copies (merge_states takes outputs of the output's dtype).
      auto widened = [](const Tensor& t) {
        Tensor w = Tensor::empty(t.view().shape_vector(), DType::kF64);
        for (int64_t i = 0; i < t.view().numel(); ++i)
          store_element(w.data(), DType::kF64, i, load_element(t.data(), t.view().dtype, i));
        return w;
      };
      const Tensor po64 = widened(po), so64 = widened(so);
      Tensor want = Tensor::empty({n, h, d}, DType::kF64),
             want_lse = Tensor::empty({h, n}, DType::kF64);
      ref->merge_states(
          {po64.view(), pl.view(), so64.view(), sl.view(), want.view(), want_lse.view(), {}});

      const Device dev = Device::cuda(0);
      Tensor gpo = Tensor::copy_of(po.view(), dev), gso = Tensor::copy_of(so.view(), dev);
      Tensor gpl = Tensor::copy_of(pl.view(), dev), gsl = Tensor::copy_of(sl.view(), dev);
      Tensor gout = Tensor::empty({n, h, d}, dt, dev),
             glse = Tensor::empty({h, n}, DType::kF32, dev);
      cuda_backend.merge_states(
          {gpo.view(), gpl.view(), gso.view(), gsl.view(), gout.view(), glse.view(), {}});
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor out = Tensor::copy_of(gout.view(), Device::cpu());
      const Tensor lse = Tensor::copy_of(glse.view(), Device::cpu());
      const ErrorStats e = compare(out.view(), want.view());
      const double tol = dt == DType::kF32 ? 1e-5 : (dt == DType::kF16 ? 2e-3 : 1.6e-2);
      EXPECT_EQ(e.mismatched_nonfinite, 0) << dtype_name(dt) << " d" << d << " " << e.to_string();
      EXPECT_LE(e.max_abs, tol * std::max(1.0, e.max_ref)) << dtype_name(dt) << " d" << d;
      const ErrorStats el = compare(lse.view(), want_lse.view());
      EXPECT_EQ(el.mismatched_nonfinite, 0) << el.to_string();
      EXPECT_LE(el.max_abs, 1e-5 * std::max(1.0, el.max_ref)) << el.to_string();
    }
  }
}

TEST(CudaAmax, MatchesTheReferenceOnStridedViewsAndPropagatesNaN) {
  REQUIRE_GPU();
  const Backend& cuda_backend = *default_registry().find("cuda");
  const auto ref = ref::make_backend();
  std::mt19937 rng(5);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kFp8E4M3}) {
    Tensor x = random_host({9, 6, 40}, dt, rng, 3);
    Tensor gx = Tensor::copy_of(x.view(), Device::cuda(0));
    const TensorView strided = gx.view().slice(2, 3, 35).permute({1, 0, 2});
    const TensorView host_strided = x.view().slice(2, 3, 35).permute({1, 0, 2});
    EXPECT_EQ(cuda_backend.amax(strided), ref->amax(host_strided)) << dtype_name(dt);
  }
  Tensor x = random_host({1000}, DType::kF32, rng);
  x.data_as<float>()[517] = std::nanf("");
  EXPECT_TRUE(std::isnan(cuda_backend.amax(Tensor::copy_of(x.view(), Device::cuda(0)).view())));
}

// ---- GPU: CUDA graphs and checked mode ------------------------------------------------------

// A decode step whose metadata lives in fixed device buffers, over a random full cache.
struct DeviceStep {
  AttentionConfig config;
  int num_blocks = 0;
  Tensor host_cache;     // physical storage on the host (for the reference)
  Tensor cache;          // the same bytes on the device
  Tensor query;          // device [T, Hq, D]
  StepMetadata step;     // host arrays; its device copies are the captured buffers
  AttentionMetadata md;  // device view

  KVCacheView cache_view() const { return KVCacheView::from_combined(cache.view()); }
  KVCacheView host_cache_view() const { return KVCacheView::from_combined(host_cache.view()); }
  // A forward of this step into `out` on `stream` (no plan).
  ForwardArgs forward_args(const Tensor& out, cudaStream_t stream) const {
    ForwardArgs f;
    f.query = query.view();
    f.kv_cache = cache_view();
    f.metadata = &md;
    f.output = out.view();
    f.stream = {stream};
    return f;
  }
};

StepMetadata make_step(const std::vector<int>& context, const std::vector<int>& q_lens,
                       int block_size, int num_blocks, std::mt19937& rng) {
  std::vector<int32_t> pool(size_t(num_blocks - 1));
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = int32_t(i + 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  MetadataBuilder b(block_size);
  size_t next = 0;
  for (size_t r = 0; r < context.size(); ++r) {
    RequestSpec s;
    s.context_len = context[r];
    s.num_new_tokens = q_lens[r];
    const int blocks = (context[r] + q_lens[r] + block_size - 1) / block_size;
    for (int i = 0; i < blocks; ++i) s.block_ids.push_back(pool[next++ % pool.size()]);
    b.add(s);
  }
  return b.build();
}

// A GQA bf16 step of requests with these contexts and query lengths (by default four decodes,
// one of them speculative, its max_seq_len raised to 8192 so that new metadata may grow into
// the captured buffers).
DeviceStep make_device_step(std::mt19937& rng,
                            const std::vector<int>& context = {3000, 6500, 700, 2000},
                            const std::vector<int>& q_lens = {1, 1, 1, 4}, int num_blocks = 2048,
                            int max_seq_len = 8192) {
  DeviceStep s;
  s.config = gqa_config();
  s.num_blocks = num_blocks;
  const AttentionConfig& c = s.config;
  KVCache host = KVCache::allocate(c, s.num_blocks);
  s.host_cache = random_host(host.storage().view().shape_vector(), c.cache_dtype(), rng);
  s.cache = Tensor::copy_of(s.host_cache.view(), Device::cuda(0));
  s.step = make_step(context, q_lens, c.block_size, s.num_blocks, rng);
  if (max_seq_len > 0) s.step.max_seq_len = max_seq_len;
  s.md = s.step.to_device(Device::cuda(0));
  s.query = Tensor::copy_of(
      random_host({s.md.num_actual_tokens, c.num_heads, c.head_size}, c.dtype, rng).view(),
      Device::cuda(0));
  return s;
}

// Output of the float64 reference for the step's current host arrays.
Tensor reference_output(const DeviceStep& s, const Backend& ref) {
  const AttentionMetadata md = s.step.view();
  Tensor q = Tensor::copy_of(s.query.view(), Device::cpu());
  Tensor out =
      Tensor::empty({md.num_actual_tokens, s.config.num_heads, s.config.head_size}, DType::kF64);
  ForwardArgs f;
  f.query = q.view();
  f.kv_cache = s.host_cache_view();
  f.metadata = &md;
  f.output = out.view();
  ref.make_impl(s.config, Device::cpu())->forward(f);
  return out;
}

// One forward captured on `stream` into *graph and instantiated into *exec.
void capture_forward(AttentionImpl& impl, const ForwardArgs& f, cudaStream_t stream,
                     cudaGraph_t* graph, cudaGraphExec_t* exec) {
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  impl.forward(f);
  ASSERT_EQ(cudaStreamEndCapture(stream, graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(exec, *graph, 0), cudaSuccess);
}

TEST(CudaGraph, ReplayWithNewMetadataInTheSameBuffersMatchesAFreshLaunch) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  DeviceStep s = make_device_step(rng);
  const auto backend = cuda::make_backend({false, 4});  // splits: the combine is captured too
  const auto ref = ref::make_backend();
  auto impl = backend->make_impl(s.config, Device::cuda(0));
  const auto plan = backend->plan(s.md, s.config);
  Tensor workspace = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, Device::cuda(0));
  Tensor out = Tensor::empty(s.query.view().shape_vector(), s.config.dtype, Device::cuda(0));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ForwardArgs f = s.forward_args(out, stream);
  f.plan = plan.get();
  f.workspace = {workspace.data(), plan->workspace_bytes()};

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_NO_FATAL_FAILURE(capture_forward(*impl, f, stream, &graph, &exec));

  auto run_both = [&](const char* when) {
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const Tensor replayed = Tensor::copy_of(out.view(), Device::cpu());
    impl->forward(f);  // a fresh launch on the same buffers
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const Tensor fresh = Tensor::copy_of(out.view(), Device::cpu());
    EXPECT_EQ(std::memcmp(replayed.data(), fresh.data(), fresh.view().nbytes()), 0) << when;
    const ErrorStats e = compare(fresh.view(), reference_output(s, *ref).view());
    EXPECT_EQ(e.mismatched_nonfinite, 0) << when;
    EXPECT_LT(e.max_abs, 2e-2) << when << ": " << e.to_string();
  };
  run_both("as captured");

  // New lengths and new blocks, same scalars (num_seqs, tokens, max lengths): written into the
  // very buffers the graph reads.
  StepMetadata next =
      make_step({4100, 260, 6000, 1500}, {1, 1, 1, 4}, s.config.block_size, s.num_blocks, rng);
  std::vector<int32_t> table(s.step.block_table.size(), 0);
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < next.max_blocks_per_seq && j < s.step.max_blocks_per_seq; ++j) {
      table[size_t(r * s.step.max_blocks_per_seq + j)] =
          next.block_table[size_t(r * next.max_blocks_per_seq + j)];
    }
  }
  ASSERT_GE(s.step.max_blocks_per_seq, next.max_blocks_per_seq);
  s.step.seq_lens = next.seq_lens;
  s.step.block_table = table;
  s.step.slot_mapping = next.slot_mapping;
  ASSERT_EQ(cudaMemcpy(s.md.seq_lens.data, s.step.seq_lens.data(), s.step.seq_lens.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(s.md.block_table.data, table.data(), table.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  run_both("replayed with new metadata");

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The Hopper prefill's dynamic walk across graph replays: each launch must leave the layer's
// counter at 0 for the next (a replay finding it where the last launch left it would take no
// work tile past the CTAs' first ones and leave the rest of the rows unwritten). The output is
// poisoned before every replay; as many CTAs as are resident, and two (each walking ~750 work
// tiles, some of them empty: three of the four requests are shorter than the longest).
TEST(CudaGraph, PrefillReplaysTakeEveryWorkTile) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  DeviceStep s = make_device_step(rng, {0, 500, 300, 200}, {1500, 1200, 1400, 800}, 512, 0);
  const AttentionConfig& c = s.config;
  // 47 q tiles of 128 packed rows per request (1500 x 4 / 128), most of them with rows.
  ASSERT_TRUE(cuda::prefill::dynamic_walk_pays(s.md.num_actual_tokens, 4, 4, 128, 47));
  const Tensor want = reference_output(s, *ref::make_backend());
  for (int persistent : {std::numeric_limits<int>::max(), 2}) {
    cuda::BackendOptions o;
    o.prefill_persistent = persistent;
    ASSERT_TRUE(o.prefill_dynamic);
    auto impl = cuda::make_backend(o)->make_impl(c, Device::cuda(0));
    Tensor out = Tensor::empty(s.query.view().shape_vector(), c.dtype, Device::cuda(0));
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const ForwardArgs f = s.forward_args(out, stream);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_NO_FATAL_FAILURE(capture_forward(*impl, f, stream, &graph, &exec));
    for (int replay = 0; replay < 3; ++replay) {
      ASSERT_EQ(cudaMemsetAsync(out.data(), 0xff, out.view().nbytes(), stream), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const ErrorStats e = compare(Tensor::copy_of(out.view(), Device::cpu()).view(), want.view());
      EXPECT_EQ(e.mismatched_nonfinite, 0) << "persistent " << persistent << " replay " << replay;
      EXPECT_LT(e.max_abs, 2e-2) << "persistent " << persistent << " replay " << replay << ": "
                                 << e.to_string();
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

TEST(CudaChecked, CatchesABlockPastTheCache) {
  REQUIRE_GPU();
  std::mt19937 rng(9);
  DeviceStep s = make_device_step(rng);
  const auto backend = cuda::make_backend({true, 0});
  auto impl = backend->make_impl(s.config, Device::cuda(0));
  const int32_t bad = s.num_blocks + 5;
  ASSERT_EQ(
      cudaMemcpy(static_cast<int32_t*>(s.md.block_table.data) + 1, &bad, 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  Tensor out = Tensor::empty(s.query.view().shape_vector(), s.config.dtype, Device::cuda(0));
  ForwardArgs f;
  f.query = s.query.view();
  f.kv_cache = s.cache_view();
  f.metadata = &s.md;
  f.output = out.view();
  EXPECT_ERROR(impl->forward(f), InvalidArgument, "metadata.block_table[0][1] (2053) is outside");
}

TEST(CudaChecked, CatchesASlotOutOfRange) {
  REQUIRE_GPU();
  std::mt19937 rng(10);
  DeviceStep s = make_device_step(rng);
  const auto backend = cuda::make_backend({true, 0});
  auto impl = backend->make_impl(s.config, Device::cuda(0));
  const int64_t capacity = int64_t(s.num_blocks) * s.config.block_size;
  const int64_t bad = capacity + 3;
  ASSERT_EQ(cudaMemcpy(static_cast<int64_t*>(s.md.slot_mapping.data) + 2, &bad, 8,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  Tensor kv = Tensor::copy_of(
      random_host({s.md.num_actual_tokens, s.config.num_kv_heads, s.config.head_size},
                  s.config.dtype, rng)
          .view(),
      Device::cuda(0));
  WriteKVArgs w{kv.view(), kv.view(), s.md.slot_mapping, s.cache_view(), {}, {}};
  EXPECT_ERROR(
      impl->write_kv(w), InvalidArgument,
      detail::cat("slot_mapping[2] (", bad, ") is outside the cache's slots [0, ", capacity));
}

}  // namespace
}  // namespace pagedattn
