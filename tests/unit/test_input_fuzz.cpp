// Random damage to one argument of a valid step, sent through the Attention layer on the cpu
// and ref backends. Every call must either run, writing every output row with finite values,
// or throw pagedattn::Error with a message that names what broke. Under the asan preset
// (AddressSanitizer + UBSan) the same cases also prove that no damage reads or writes out of
// bounds: validation must stop every bad value before a backend trusts it.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/error.h"
#include "pagedattn/layer.h"

namespace pagedattn {
namespace {

// One valid decoder step over a paged cache whose every slot holds finite values.
struct Scenario {
  AttentionOptions options;
  int num_blocks = 0;
  std::vector<RequestSpec> requests;
};

Scenario random_scenario(std::mt19937& rng, const std::string& backend) {
  auto pick = [&](std::initializer_list<int> values) {
    std::uniform_int_distribution<size_t> d(0, values.size() - 1);
    return *(values.begin() + d(rng));
  };
  Scenario s;
  AttentionOptions& o = s.options;
  o.num_kv_heads = pick({1, 2});
  o.num_heads = *o.num_kv_heads * pick({1, 2, 4});
  o.head_size = pick({16, 32, 64});
  o.scale = 1.0f / std::sqrt(float(o.head_size));
  o.dtype = pick({0, 1}) ? DType::kF32 : DType::kBF16;
  o.attn_backend = backend;
  CacheConfig cache;
  cache.block_size = pick({1, 4, 16});
  cache.cache_dtype = pick({0, 0, 1}) ? KVCacheDType::kAuto : KVCacheDType::kFp8E4M3;
  if (pick({0, 0, 1})) cache.sliding_window = pick({3, 17});
  o.cache_config = cache;
  if (pick({0, 0, 1})) o.logits_soft_cap = 20.0f;

  const int num_requests = pick({1, 2, 3, 4});
  std::vector<int> free_blocks;
  int used = 0;
  for (int r = 0; r < num_requests; ++r) {
    RequestSpec req;
    req.context_len = pick({0, 0, 1, 5, 23});
    req.num_new_tokens = pick({0, 1, 1, 3, 7});
    const int seq_len = req.context_len + req.num_new_tokens;
    const int blocks = (seq_len + cache.block_size - 1) / cache.block_size + pick({0, 1});
    for (int b = 0; b < blocks; ++b) req.block_ids.push_back(used++);
    s.requests.push_back(std::move(req));
  }
  s.num_blocks = used + pick({1, 3});
  // Shuffle the physical blocks so that no request owns a contiguous range.
  std::vector<int32_t> perm(size_t(s.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (auto& req : s.requests) {
    for (auto& b : req.block_ids) b = perm[size_t(b)];
  }
  return s;
}

std::vector<float> normal_floats(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Host activations in the layer's dtype: [rows, cols] of N(0, 1).
struct Activations {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0;

  Activations(DType dt, int64_t r, int64_t c, std::mt19937& rng) : dtype(dt), rows(r), cols(c) {
    f32 = normal_floats(size_t(r * c), rng);
    if (dtype == DType::kBF16) {
      for (float x : f32) bf16.push_back(float_to_bf16(x));
    }
  }
  void* data() { return dtype == DType::kBF16 ? static_cast<void*>(bf16.data()) : f32.data(); }
  TensorView view() { return TensorView::contiguous(data(), dtype, {rows, cols}); }
};

// Editable copies of a step's metadata arrays with views over them: one damage edits the
// arrays or the views, then the layer gets the AttentionMetadata.
struct Metadata {
  // Spare room past every array, so a view made longer or strided stays inside host memory:
  // the damage must be caught by a rule, not by where the buffer happens to end.
  static constexpr size_t kSpare = 64;
  std::vector<int32_t> qsl, seq_lens, block_table, relaid_table;
  std::vector<int64_t> slots, relaid_slots;
  AttentionMetadata md;

  // Valid strided layouts of the same values, junk in between: a view of a larger table.
  void relay_block_table(bool transposed) {
    const int64_t rows = md.block_table.size(0), cols = md.block_table.size(1);
    relaid_table.assign(size_t(2 * rows * cols + 1), -7);
    const int64_t s0 = transposed ? 1 : 2 * cols, s1 = transposed ? 2 * rows : 2;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j)
        relaid_table[size_t(i * s0 + j * s1)] = block_table[size_t(i * cols + j)];
    }
    md.block_table.data = relaid_table.data();
    md.block_table.strides[0] = s0;
    md.block_table.strides[1] = s1;
  }
  void relay_slots() {
    const int64_t n = md.slot_mapping.size(0);
    relaid_slots.assign(size_t(2 * n + 1), -7);
    for (int64_t t = 0; t < n; ++t) relaid_slots[size_t(2 * t)] = slots[size_t(t)];
    md.slot_mapping.data = relaid_slots.data();
    md.slot_mapping.strides[0] = 2;
  }

  explicit Metadata(const StepMetadata& step) {
    md = step.view();
    qsl = padded(step.query_start_loc);
    seq_lens = padded(step.seq_lens);
    block_table = padded(step.block_table);
    slots = padded(step.slot_mapping);
    md.query_start_loc.data = qsl.data();
    md.query_start_loc_cpu.data = qsl.data();
    md.seq_lens.data = seq_lens.data();
    md.seq_lens_cpu.data = seq_lens.data();
    md.block_table.data = block_table.data();
    md.slot_mapping.data = slots.data();
  }
  template <class T>
  static std::vector<T> padded(const std::vector<T>& v) {
    std::vector<T> out(v);
    out.resize(v.size() + kSpare, T(7));
    return out;
  }
};

// What the validator read: every metadata view copied element by element through its strides
// into dense arrays. An accepted step rerun on these must give the same bits, so a backend that
// reads a view differently from the validator (ignores a stride) is caught.
struct DenseCopy {
  std::vector<int32_t> qsl, seq_lens, block_table;
  std::vector<int64_t> slots;
  AttentionMetadata md;

  template <class T>
  static std::vector<T> dense(const TensorView& v) {
    std::vector<T> out;
    const int64_t rows = v.size(0), cols = v.ndim == 2 ? v.size(1) : 1;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t at = i * v.stride(0) + (v.ndim == 2 ? j * v.stride(1) : 0);
        out.push_back(static_cast<const T*>(v.data)[at]);
      }
    }
    return out;
  }
  explicit DenseCopy(const AttentionMetadata& from) : md(from) {
    qsl = dense<int32_t>(from.query_start_loc_cpu);
    seq_lens = dense<int32_t>(from.seq_lens_cpu);
    block_table = dense<int32_t>(from.block_table);
    slots = dense<int64_t>(from.slot_mapping);
    md.query_start_loc = md.query_start_loc_cpu =
        TensorView::contiguous(qsl.data(), DType::kI32, {int64_t(qsl.size())});
    md.seq_lens = md.seq_lens_cpu =
        TensorView::contiguous(seq_lens.data(), DType::kI32, {int64_t(seq_lens.size())});
    md.block_table = TensorView::contiguous(block_table.data(), DType::kI32,
                                            {from.block_table.size(0), from.block_table.size(1)});
    md.slot_mapping = TensorView::contiguous(slots.data(), DType::kI64, {int64_t(slots.size())});
  }
};

// The damages, each a function of (metadata, query/key/value/output views, rng) that returns
// its name for the failure message.
struct Views {
  TensorView query, key, value, output;
};

int bad_int(std::mt19937& rng, int64_t near) {
  const int64_t choices[] = {-1, -2, INT_MIN, INT_MAX, near - 1, near + 1, near + 1000, 0};
  std::uniform_int_distribution<size_t> d(0, std::size(choices) - 1);
  const int64_t v = choices[d(rng)];
  return int(std::clamp<int64_t>(v, INT_MIN, INT_MAX));
}

template <class T>
std::string damage_element(std::vector<T>& data, int64_t size, const char* name,
                           std::mt19937& rng) {
  if (size <= 0) return std::string(name) + ": empty, untouched";
  std::uniform_int_distribution<int64_t> at(0, size - 1);
  const int64_t i = at(rng);
  const T before = data[size_t(i)];
  data[size_t(i)] = T(bad_int(rng, int64_t(before)));
  return std::string(name) + "[" + std::to_string(i) + "]: " + std::to_string(before) + " -> " +
         std::to_string(data[size_t(i)]);
}

TensorView* metadata_view(AttentionMetadata& md, int which, const char** name) {
  static const char* names[] = {"query_start_loc_cpu", "seq_lens_cpu", "block_table",
                                "slot_mapping"};
  *name = names[which];
  switch (which) {
    case 0:
      return &md.query_start_loc_cpu;
    case 1:
      return &md.seq_lens_cpu;
    case 2:
      return &md.block_table;
    default:
      return &md.slot_mapping;
  }
}

std::string damage(Metadata& m, Views& v, std::mt19937& rng) {
  AttentionMetadata& md = m.md;
  std::uniform_int_distribution<int> kind(0, 20);
  std::uniform_int_distribution<int> which(0, 3);
  const char* name = nullptr;
  switch (kind(rng)) {
    case 0:
      return "none";
    case 1:
      md.num_seqs = bad_int(rng, md.num_seqs);
      return "num_seqs -> " + std::to_string(md.num_seqs);
    case 2:
      md.num_actual_tokens = bad_int(rng, md.num_actual_tokens);
      return "num_actual_tokens -> " + std::to_string(md.num_actual_tokens);
    case 3:
      md.max_query_len = bad_int(rng, md.max_query_len);
      return "max_query_len -> " + std::to_string(md.max_query_len);
    case 4:
      md.max_seq_len = bad_int(rng, md.max_seq_len);
      return "max_seq_len -> " + std::to_string(md.max_seq_len);
    case 5:
      return damage_element(m.qsl, md.num_seqs + 1, "query_start_loc", rng);
    case 6:
      return damage_element(m.seq_lens, md.num_seqs, "seq_lens", rng);
    case 7:
      return damage_element(m.block_table, md.block_table.numel(), "block_table", rng);
    case 8:
      return damage_element(m.slots, md.slot_mapping.numel(), "slot_mapping", rng);
    case 9: {
      TensorView* t = metadata_view(md, which(rng), &name);
      *t = TensorView{};
      return std::string(name) + " undefined";
    }
    case 10: {
      TensorView* t = metadata_view(md, which(rng), &name);
      t->dtype = t->dtype == DType::kI32 ? DType::kI64 : DType::kI32;
      return std::string(name) + " dtype changed";
    }
    case 11: {
      TensorView* t = metadata_view(md, which(rng), &name);
      t->shape[0] += std::uniform_int_distribution<int>(0, 1)(rng) ? 1 : -1;
      if (t->shape[0] < 0) t->shape[0] = 0;
      return std::string(name) + " size(0) -> " + std::to_string(t->shape[0]);
    }
    case 12: {
      TensorView* t = metadata_view(md, which(rng), &name);
      const int dim = t->ndim - 1;
      t->strides[size_t(dim)] *= 2;
      return std::string(name) + " stride(" + std::to_string(dim) + ") doubled";
    }
    case 13:
      md.causal = !md.causal;
      return "causal flipped";
    case 14:
      md.query_start_loc_cpu = TensorView{};
      md.seq_lens_cpu = TensorView{};
      return "host mirrors undefined";
    case 15: {
      const int64_t rows = v.query.size(0);
      v.query.shape[0] = rows > 0 ? rows - 1 : 0;
      return "query rows -> " + std::to_string(v.query.shape[0]);
    }
    case 16: {
      const int64_t rows = v.key.size(0);
      v.key.shape[0] = rows > 0 ? rows - 1 : 0;
      return "key rows -> " + std::to_string(v.key.shape[0]);
    }
    case 17: {
      const int64_t rows = v.output.size(0);
      v.output.shape[0] = rows > 0 ? rows - 1 : 0;
      return "output rows -> " + std::to_string(v.output.shape[0]);
    }
    case 18:
      m.relay_block_table(false);
      return "block_table re-laid with column stride 2 (valid)";
    case 19:
      m.relay_block_table(true);
      return "block_table re-laid column-major (valid)";
    default:
      m.relay_slots();
      return "slot_mapping re-laid with stride 2";  // write_kv wants it dense
  }
}

// Writes finite K/V into every slot of the layer's cache: one request owning every block.
void fill_cache(ForwardContext& ctx, Attention& layer, int num_blocks, std::mt19937& rng) {
  const AttentionConfig& c = layer.config();
  RequestSpec all;
  all.num_new_tokens = num_blocks * c.block_size;
  for (int b = 0; b < num_blocks; ++b) all.block_ids.push_back(b);
  StepMetadata step = MetadataBuilder(c.block_size).add(all).build();
  AttentionMetadata md = step.view();
  const int64_t t = all.num_new_tokens;
  Activations q(c.dtype, t, c.num_heads * c.head_size, rng);
  Activations k(c.dtype, t, c.num_kv_heads * c.head_size, rng);
  Activations v(c.dtype, t, c.num_kv_heads * c.head_size, rng);
  ctx.begin_step({&md});
  layer.forward(q.view(), k.view(), v.view());
  ctx.end_step();
}

bool all_finite(const TensorView& out, int64_t rows) {
  const int64_t cols = out.size(1);
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (!std::isfinite(load_element(out.data, out.dtype, i))) return false;
  }
  return true;
}

class InputFuzz : public ::testing::TestWithParam<std::string> {};

TEST_P(InputFuzz, EveryDamageIsRefusedOrHarmless) {
  const std::string backend = GetParam();
  constexpr int kCases = 600;
  std::map<std::string, int> refusals;  // first words of each error, for the summary
  int ran = 0;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0x5eed0000u + i));
    Scenario s = random_scenario(rng, backend);
    s.options.prefix = "fuzz." + std::to_string(i);
    ForwardContext ctx;
    Attention layer(ctx, s.options);
    KVCache cache = KVCache::allocate(layer.config(), s.num_blocks);
    layer.bind_kv_cache({cache.view()});
    fill_cache(ctx, layer, s.num_blocks, rng);

    MetadataBuilder builder(layer.config().block_size);
    for (const auto& r : s.requests) builder.add(r);
    StepMetadata step = builder.build();
    Metadata m(step);
    const AttentionConfig& c = layer.config();
    const int64_t tokens = m.md.num_actual_tokens;
    Activations q(c.dtype, tokens, c.num_heads * c.head_size, rng);
    Activations k(c.dtype, tokens, c.num_kv_heads * c.head_size, rng);
    Activations v(c.dtype, tokens, c.num_kv_heads * c.head_size, rng);
    // All-ones bits: NaN in float32 and in bfloat16, so an unwritten element cannot pass.
    std::vector<uint32_t> out_data(size_t(tokens * c.num_heads * c.head_size) + 1, 0xffffffffu);
    Views views{q.view(), k.view(), v.view(),
                TensorView::contiguous(out_data.data(), c.dtype,
                                       {tokens, int64_t(c.num_heads) * c.head_size})};
    const std::string what = damage(m, views, rng);
    SCOPED_TRACE("case " + std::to_string(i) + " (" + backend + "): " + what);
    // A sanitizer stops the process without the trace: PAGEDATTN_FUZZ_VERBOSE names the case.
    if (std::getenv("PAGEDATTN_FUZZ_VERBOSE"))
      std::fprintf(stderr, "case %d: %s\n", i, what.c_str());

    ctx.begin_step({&m.md});
    try {
      layer.forward(views.query, views.key, views.value, views.output);
      ctx.end_step();
      ++ran;
      EXPECT_TRUE(all_finite(views.output, tokens))
          << "an accepted step left a row unwritten or wrote a non-finite value";
      // The same step on dense copies writes the same K/V to the same slots and must give
      // the same bits.
      DenseCopy dense(m.md);
      std::vector<uint32_t> again(out_data.size(), 0xffffffffu);
      TensorView out2 = views.output;
      out2.data = again.data();
      ctx.begin_step({&dense.md});
      layer.forward(views.query, views.key, views.value, out2);
      ctx.end_step();
      EXPECT_EQ(0, std::memcmp(out_data.data(), again.data(), views.output.nbytes()))
          << "the backend read the metadata differently from the validator";
    } catch (const Error& e) {
      ctx.end_step();
      const std::string msg = e.what();
      EXPECT_FALSE(msg.empty());
      const bool valid = what == "none" || what.find("(valid)") != std::string::npos;
      EXPECT_FALSE(valid) << "a valid step was refused: " << msg;
      refusals[msg.substr(0, msg.find_first_of(" ([:"))]++;
    } catch (const std::exception& e) {
      ctx.end_step();
      ADD_FAILURE() << "threw a non-pagedattn exception: " << e.what();
    }
  }
  std::string summary;
  for (const auto& [head, n] : refusals) summary += " " + head + ":" + std::to_string(n);
  std::printf("[fuzz %s] %d of %d cases ran; refusals by first word:%s\n", backend.c_str(), ran,
              kCases, summary.c_str());
  // The damages include "none" and harmless ones (a larger max_seq_len); most must be refused.
  EXPECT_GT(ran, kCases / 20);
  EXPECT_GT(kCases - ran, kCases / 2);
}

INSTANTIATE_TEST_SUITE_P(Backends, InputFuzz, ::testing::Values("cpu", "ref"));

}  // namespace
}  // namespace pagedattn
