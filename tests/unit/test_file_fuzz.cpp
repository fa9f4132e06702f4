// Damaged case files: a random valid case (every attention type) serialised to safetensors
// bytes, one damage to the bytes, then parse -> case -> run on the cpu backend. Each stage must
// either succeed or throw pagedattn::Error; under the asan preset none may read or write out of
// bounds, however the header's numbers (shapes, offsets, lengths) lie.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/case_file.h"
#include "pagedattn/error.h"
#include "pagedattn/registry.h"
#include "pagedattn/safetensors.h"

namespace pagedattn {
namespace {

CaseSpec random_spec(std::mt19937& rng) {
  auto pick = [&](std::initializer_list<int> values) {
    std::uniform_int_distribution<size_t> d(0, values.size() - 1);
    return *(values.begin() + d(rng));
  };
  CaseSpec s;
  s.seed = rng();
  s.attn_type = static_cast<AttentionType>(pick({0, 0, 1, 2, 3}));
  s.num_kv_heads = pick({1, 2});
  s.num_heads = s.num_kv_heads * pick({1, 2});
  s.head_size = pick({16, 32});
  s.dtype = pick({0, 1}) ? DType::kBF16 : DType::kF32;
  s.block_size = pick({1, 4, 16});
  const bool cached =
      s.attn_type == AttentionType::kDecoder || s.attn_type == AttentionType::kEncoderDecoder;
  if (cached && pick({0, 0, 1})) s.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  if (pick({0, 0, 1})) s.logits_soft_cap = 15.0f;
  s.requests.clear();
  const int n = pick({1, 2, 3});
  for (int r = 0; r < n; ++r) {
    const int ctx = s.attn_type == AttentionType::kDecoder ? pick({0, 3, 17}) : 0;
    s.requests.push_back({ctx, pick({1, 2, 5})});
  }
  s.pad_tokens = pick({0, 2});
  if (s.kv_cache_dtype != KVCacheDType::kAuto && pick({0, 1})) {
    // Per-KV-head scales: tensors whose damaged bytes or lengths the loader must refuse.
    for (int h = 0; h < s.num_kv_heads; ++h) {
      s.scales.k_scales.push_back(0.25f * float(h + 1));
      s.scales.v_scales.push_back(2.0f / float(h + 1));
    }
  }
  return s;
}

// One damage to the serialised bytes; returns its description.
std::string damage(std::vector<uint8_t>& bytes, std::mt19937& rng) {
  auto index = [&](size_t lo, size_t hi) {  // [lo, hi)
    return std::uniform_int_distribution<size_t>(lo, hi - 1)(rng);
  };
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[size_t(i)];
  const size_t header_end = size_t(8 + header_len);
  switch (std::uniform_int_distribution<int>(0, 6)(rng)) {
    case 0: {  // a digit of the JSON header (a shape, an offset or a metadata number)
      std::vector<size_t> digits;
      for (size_t i = 8; i < header_end; ++i) {
        if (bytes[i] >= '0' && bytes[i] <= '9') digits.push_back(i);
      }
      const size_t at = digits[index(0, digits.size())];
      const char before = char(bytes[at]);
      const char* replacements = "0123456789-";
      bytes[at] = uint8_t(replacements[index(0, 11)]);
      return "header digit at " + std::to_string(at) + ": " + before + " -> " + char(bytes[at]);
    }
    case 1: {  // digits appended to a number: a huge shape or offset
      std::vector<size_t> digits;
      for (size_t i = 8; i < header_end; ++i) {
        if (bytes[i] >= '0' && bytes[i] <= '9') digits.push_back(i);
      }
      const size_t at = digits[index(0, digits.size())];
      bytes.insert(bytes.begin() + long(at), {'9', '9', '9', '9', '9', '9', '9', '9', '9', '9'});
      // Keep the length field honest so the parser reaches the number.
      const uint64_t len = header_len + 10;
      for (int i = 0; i < 8; ++i) bytes[size_t(i)] = uint8_t(len >> (8 * i));
      return "header number at " + std::to_string(at) + " made huge";
    }
    case 2: {
      const size_t at = index(0, bytes.size());
      bytes[at] ^= uint8_t(1u << index(0, 8));
      return "bit flip at byte " + std::to_string(at);
    }
    case 3: {
      const size_t keep = index(0, bytes.size());
      bytes.resize(keep);
      return "truncated to " + std::to_string(keep) + " bytes";
    }
    case 4: {
      const uint64_t lies[] = {0,
                               1,
                               header_len - 1,
                               header_len + 1,
                               uint64_t(bytes.size()),
                               ~uint64_t(0),
                               uint64_t(1) << 40};
      const uint64_t len = lies[index(0, std::size(lies))];
      for (int i = 0; i < 8; ++i) bytes[size_t(i)] = uint8_t(len >> (8 * i));
      return "header length -> " + std::to_string(len);
    }
    case 5:
      return "metadata element";  // applied to the loaded case: see damage_metadata
    default: {                    // a tensor's data bytes (values, metadata arrays): any bits
      if (header_end >= bytes.size()) return "no data bytes";
      for (int k = 0; k < 4; ++k) bytes[index(header_end, bytes.size())] = uint8_t(rng());
      return "four data bytes randomised";
    }
  }
}

// One element of a loaded case's metadata arrays set to a bad value (the byte damages above
// rarely land in these small arrays).
std::string damage_metadata(Case& c, std::mt19937& rng) {
  Tensor* arrays[] = {&c.query_start_loc, &c.seq_lens, &c.block_table, &c.slot_mapping};
  const char* names[] = {"query_start_loc", "seq_lens", "block_table", "slot_mapping"};
  const size_t which = std::uniform_int_distribution<size_t>(0, 3)(rng);
  const TensorView& v = arrays[which]->view();
  if (v.numel() == 0) return std::string(names[which]) + " is empty";
  const int64_t at = std::uniform_int_distribution<int64_t>(0, v.numel() - 1)(rng);
  const int64_t before = int64_t(load_element(v.data, v.dtype, at));
  const int64_t bad[] = {-1, -2, INT32_MIN, INT32_MAX, before - 1, before + 1, before + 1000};
  const int64_t value = bad[std::uniform_int_distribution<size_t>(0, std::size(bad) - 1)(rng)];
  if (v.dtype == DType::kI64) {
    static_cast<int64_t*>(v.data)[at] = value;
  } else {
    static_cast<int32_t*>(v.data)[at] = int32_t(value);
  }
  return std::string(names[which]) + "[" + std::to_string(at) + "]: " + std::to_string(before) +
         " -> " + std::to_string(value);
}

TEST(FileFuzz, DamagedCaseFilesAreRefusedOrRun) {
  constexpr int kCases = 400;
  const Backend& cpu = *default_registry().find("cpu");
  int parsed = 0, loaded = 0, ran = 0;
  for (int i = 0; i < kCases; ++i) {
    std::mt19937 rng(uint32_t(0xf11e0000u + i));
    const Case original = make_random_case(random_spec(rng));
    std::vector<uint8_t> bytes = serialize_safetensors(case_to_safetensors(original));
    std::string what = damage(bytes, rng);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + what);
    // A sanitizer stops the process without the trace: PAGEDATTN_FUZZ_VERBOSE names the case.
    if (std::getenv("PAGEDATTN_FUZZ_VERBOSE")) {
      std::fprintf(stderr, "case %d: %s\n", i, what.c_str());
    }
    try {
      const SafeTensors file = parse_safetensors(bytes);
      ++parsed;
      Case c = case_from_safetensors(file);
      if (what == "metadata element") {
        what += ": " + damage_metadata(c, rng);
        if (std::getenv("PAGEDATTN_FUZZ_VERBOSE")) std::fprintf(stderr, "  %s\n", what.c_str());
      }
      ++loaded;
      const CaseResult result = run_case(c, cpu);
      ++ran;
      (void)check_case(c, result);
    } catch (const Error& e) {
      EXPECT_FALSE(std::string(e.what()).empty());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw a non-pagedattn exception: " << e.what();
    }
  }
  std::printf("[file fuzz] %d of %d parsed, %d loaded as cases, %d ran\n", parsed, kCases, loaded,
              ran);
  // Data-byte damage leaves the file well-formed, so some cases must get through every stage.
  EXPECT_GT(ran, kCases / 20);
  EXPECT_LT(ran, kCases);
}

}  // namespace
}  // namespace pagedattn
