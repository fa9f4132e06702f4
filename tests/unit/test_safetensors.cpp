// The safetensors reader and writer: round trips of every dtype, one hand-built file per rule
// of the reader (each test fails when its rule is removed), and a truncation / bit-flip loop
// that may only ever end in FormatError.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "pagedattn/error.h"
#include "pagedattn/safetensors.h"

namespace pagedattn {
namespace {

using Bytes = std::vector<uint8_t>;

// A file from a header text and a data buffer, with the length written as given.
Bytes file_bytes(const std::string& header, const Bytes& data = {},
                 std::optional<uint64_t> header_len = std::nullopt) {
  const uint64_t n = header_len.value_or(header.size());
  // Sized once and filled by copy: GCC 12 at -O3 warns falsely (-Warray-bounds) on inserts
  // into a freshly sized vector.
  Bytes out(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + long(header.size()));
  return out;
}

Bytes zeros(size_t n) {
  return Bytes(n, 0);
}

// A tensor whose bytes count 0, 1, 2, ... (every dtype, any pattern is a valid value).
Tensor patterned(const std::vector<int64_t>& shape, DType dtype, uint8_t start = 0) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.data());
  for (size_t i = 0; i < t.view().nbytes(); ++i) p[i] = uint8_t(start + i * 7);
  return t;
}

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape_vector() == b.shape_vector() &&
         std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("pagedattn_safetensors_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

const DType kAllDTypes[] = {DType::kF64,  DType::kF32,     DType::kF16,
                            DType::kBF16, DType::kFp8E4M3, DType::kFp8E5M2,
                            DType::kI64,  DType::kI32,     DType::kU8};

TEST(SafeTensors, DTypeNames) {
  for (DType d : kAllDTypes) {
    EXPECT_EQ(dtype_from_safetensors_name(safetensors_dtype_name(d)), d);
  }
  EXPECT_EQ(safetensors_dtype_name(DType::kFp8E4M3), "F8_E4M3");
  EXPECT_EQ(safetensors_dtype_name(DType::kBF16), "BF16");
  for (const char* unsupported : {"I16", "BOOL", "I8", "U16", "F8_E8M0", "f32", ""}) {
    EXPECT_FALSE(dtype_from_safetensors_name(unsupported)) << unsupported;
  }
}

TEST(SafeTensors, RoundTripEveryDType) {
  SafeTensors f;
  uint8_t start = 1;
  for (DType d : kAllDTypes) {
    f.tensors[std::string(safetensors_dtype_name(d))] = patterned({2, 3, 5}, d, start++);
  }
  f.tensors["empty"] = Tensor::empty({0, 4}, DType::kF32);
  f.tensors["rank6"] = patterned({1, 2, 1, 2, 1, 3}, DType::kU8);
  f.metadata = {{"a", "1"}, {"name", "caf\xc3\xa9"}, {"empty", ""}};
  const Bytes bytes = serialize_safetensors(f);
  const SafeTensors g = parse_safetensors(bytes);
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    const Tensor* back = g.find(name);
    ASSERT_NE(back, nullptr) << name;
    EXPECT_TRUE(same_bytes(t.view(), back->view())) << name;
  }
  EXPECT_EQ(g.metadata, f.metadata);
  EXPECT_EQ(serialize_safetensors(g), bytes) << "writing is deterministic";
}

TEST(SafeTensors, HeaderIsPaddedWithSpacesTo8Bytes) {
  for (int n = 1; n < 12; ++n) {
    SafeTensors f;
    f.tensors[std::string(size_t(n), 'x')] = patterned({3}, DType::kU8);
    const Bytes bytes = serialize_safetensors(f);
    uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = (len << 8) | bytes[size_t(i)];
    EXPECT_EQ(len % 8, 0u);
    EXPECT_EQ(bytes.size(), 8 + len + 3);
    EXPECT_EQ(bytes[8], '{');
    for (uint64_t i = 8 + len - 1; bytes[i] != '}'; --i) EXPECT_EQ(bytes[i], ' ');
  }
}

TEST(SafeTensors, WritesStridedTensorsContiguously) {
  Tensor t = patterned({3, 4}, DType::kI32);
  Tensor transposed = t;
  transposed.view() = t.view().permute({1, 0});  // [4, 3], not contiguous
  SafeTensors f;
  f.tensors["t"] = transposed;
  const SafeTensors g = parse_safetensors(serialize_safetensors(f));
  const TensorView& back = g.find("t")->view();
  ASSERT_EQ(back.shape_vector(), (std::vector<int64_t>{4, 3}));
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(back.data_as<int32_t>()[i * 3 + j], t.data_as<int32_t>()[j * 4 + i]);
    }
  }
}

TEST(SafeTensors, SaveAndLoadAtomically) {
  const std::string path = temp_path("roundtrip.safetensors");
  SafeTensors f;
  f.tensors["x"] = patterned({4, 2}, DType::kBF16);
  f.metadata["k"] = "v";
  save_safetensors(path, f);
  save_safetensors(path, f);  // overwrites
  const SafeTensors g = load_safetensors(path);
  EXPECT_TRUE(same_bytes(f.find("x")->view(), g.find("x")->view()));
  EXPECT_EQ(*g.find_metadata("k"), "v");
  for (const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos)
        << "temporary file left behind: " << entry.path();
  }
  EXPECT_ERROR(load_safetensors(path + ".missing"), Error, ".missing");
  EXPECT_ERROR(load_safetensors(std::filesystem::path(path).parent_path().string()), Error,
               "not a regular file");
  EXPECT_ERROR(save_safetensors(temp_path("no/such/dir/x.safetensors"), f), Error, "cannot create");
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(SafeTensors, LoadNamesThePathOfAMalformedFile) {
  const std::string path = temp_path("bad.safetensors");
  const Bytes bytes = file_bytes("[]");
  std::FILE* out = std::fopen(path.c_str(), "wb");
  ASSERT_NE(out, nullptr);
  std::fwrite(bytes.data(), 1, bytes.size(), out);
  std::fclose(out);
  EXPECT_ERROR(load_safetensors(path), FormatError, path + ": safetensors: header must be");
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(SafeTensors, ScalarIsReadAsOneElement) {
  const SafeTensors f = parse_safetensors(
      file_bytes(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})", zeros(4)));
  EXPECT_EQ(f.find("s")->view().shape_vector(), (std::vector<int64_t>{1}));
}

TEST(SafeTensors, MetadataScalarsBecomeStrings) {
  const SafeTensors f = parse_safetensors(
      file_bytes(R"({"__metadata__":{"s":"x","i":32,"f":0.125,"b":true,"n":null,"neg":-1}})"));
  EXPECT_EQ(f.metadata.at("s"), "x");
  EXPECT_EQ(f.metadata.at("i"), "32");
  EXPECT_EQ(f.metadata.at("f"), "0.125");
  EXPECT_EQ(f.metadata.at("b"), "true");
  EXPECT_EQ(f.metadata.at("n"), "null");
  EXPECT_EQ(f.metadata.at("neg"), "-1");
  EXPECT_TRUE(f.tensors.empty());
}

TEST(SafeTensors, AcceptsTrailingSpacesAndAnEmptyFile) {
  EXPECT_NO_THROW(parse_safetensors(file_bytes("{}      ")));
  EXPECT_NO_THROW(
      parse_safetensors(file_bytes(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})")));
}

TEST(SafeTensors, WriterRejectsWhatItCannotWrite) {
  SafeTensors f;
  f.tensors["__metadata__"] = patterned({1}, DType::kU8);
  EXPECT_ERROR(serialize_safetensors(f), InvalidArgument, "__metadata__");
  f.tensors.clear();
  f.tensors["undefined"] = Tensor();
  EXPECT_ERROR(serialize_safetensors(f), InvalidArgument, "'undefined' is undefined");
  f.tensors.clear();
  f.metadata["bad"] = "\xff\xfe";
  EXPECT_ERROR(serialize_safetensors(f), InvalidArgument, "UTF-8");
}

// One malformed file per rule.
struct Malformed {
  const char* rule;
  Bytes bytes;
  const char* message;
};

std::vector<Malformed> malformed_files() {
  const std::string u8_4 = R"({"dtype":"U8","shape":[4],"data_offsets":)";
  return {
      {"shorter than 8 bytes", Bytes{1, 0, 0}, "file has 3 bytes"},
      {"header length past the file", file_bytes("{}", {}, 100), "runs past the end of the file"},
      {"header length absurd", file_bytes("{}", {}, uint64_t(1) << 63), "exceeds the limit"},
      {"header length just above the limit", file_bytes("{}", {}, kMaxSafetensorsHeaderBytes + 1),
       "exceeds the limit"},
      {"empty header", file_bytes(""), "not valid JSON"},
      {"not JSON", file_bytes("{not json}"), "not valid JSON"},
      {"trailing garbage", file_bytes("{}x"), "not valid JSON"},
      {"invalid UTF-8", file_bytes("{\"\xff\":1}"), "not valid JSON"},
      {"not an object", file_bytes("[1, 2]"), "must be a JSON object; got array"},
      {"entry not an object", file_bytes(R"({"t":[1]})"), "tensor 't' must be an object"},
      {"missing dtype", file_bytes(R"({"t":{"shape":[0],"data_offsets":[0,0]}})"),
       "tensor 't' has no 'dtype'"},
      {"missing shape", file_bytes(R"({"t":{"dtype":"U8","data_offsets":[0,0]}})"),
       "tensor 't' has no 'shape'"},
      {"missing data_offsets", file_bytes(R"({"t":{"dtype":"U8","shape":[0]}})"),
       "tensor 't' has no 'data_offsets'"},
      {"dtype not a string", file_bytes(R"({"t":{"dtype":1,"shape":[0],"data_offsets":[0,0]}})"),
       "'dtype' must be a string"},
      {"unknown dtype I16",
       file_bytes(R"({"t":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}})", zeros(4)),
       "dtype 'I16' is not supported"},
      {"unknown dtype BOOL",
       file_bytes(R"({"t":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})", zeros(4)),
       "dtype 'BOOL' is not supported"},
      {"shape not an array", file_bytes(R"({"t":{"dtype":"U8","shape":4,"data_offsets":[0,4]}})"),
       "'shape' must be an array"},
      {"shape entry not an integer",
       file_bytes(R"({"t":{"dtype":"U8","shape":["4"],"data_offsets":[0,4]}})", zeros(4)),
       "shape[0] must be a non-negative integer"},
      {"shape entry a float",
       file_bytes(R"({"t":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}})", zeros(4)),
       "shape[0] must be a non-negative integer"},
      {"negative dimension",
       file_bytes(R"({"t":{"dtype":"U8","shape":[2,-2],"data_offsets":[0,4]}})", zeros(4)),
       "shape[1] (-2) is negative"},
      {"dimension past int64",
       file_bytes(R"({"t":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,4]}})",
                  zeros(4)),
       "shape[0] (18446744073709551615) exceeds"},
      {"too many dimensions",
       file_bytes(R"({"t":{"dtype":"U8","shape":[1,1,1,1,1,1,1],"data_offsets":[0,1]}})", zeros(1)),
       "shape has 7 dimensions; at most 6"},
      {"offsets not a pair", file_bytes(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[0]}})"),
       "'data_offsets' must be [begin, end]"},
      {"offsets negative", file_bytes(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[-1,0]}})"),
       "data_offsets[0] (-1) is negative"},
      {"offsets float", file_bytes(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0.0]}})"),
       "data_offsets[1] must be a non-negative integer"},
      {"size mismatch",
       file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", zeros(4)),
       "shape [2] of F32 needs 8 bytes but data_offsets [0, 4] hold 4"},
      {"shape product overflows",
       file_bytes(R"({"t":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],)"
                  R"("data_offsets":[0,4]}})",
                  zeros(4)),
       "needs more than 2^64 bytes"},
      {"shape times dtype size overflows",
       file_bytes(R"({"t":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})",
                  zeros(8)),
       "needs more than 2^64 bytes"},
      {"end past the data buffer", file_bytes(R"({"t":)" + u8_4 + "[0,4]}}", zeros(3)),
       "data_offsets end (4) is past the data buffer (3 bytes)"},
      {"huge offsets",
       file_bytes(R"({"t":)" + u8_4 + "[18446744073709551611,18446744073709551615]}}", zeros(4)),
       "exceeds"},
      {"begin after end",
       file_bytes(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", zeros(4)),
       "data_offsets begin (4) is after end (0)"},
      {"overlap", file_bytes(R"({"a":)" + u8_4 + R"([0,4]},"b":)" + u8_4 + "[2,6]}}", zeros(6)),
       "tensor 'b' (bytes [2, 6)) overlaps tensor 'a'"},
      {"identical ranges",
       file_bytes(R"({"a":)" + u8_4 + R"([0,4]},"b":)" + u8_4 + "[0,4]}}", zeros(4)), "overlaps"},
      {"hole", file_bytes(R"({"a":)" + u8_4 + R"([0,4]},"b":)" + u8_4 + "[6,10]}}", zeros(10)),
       "bytes [4, 6) of the data buffer belong to no tensor"},
      {"hole at the start", file_bytes(R"({"a":)" + u8_4 + "[2,6]}}", zeros(6)),
       "bytes [0, 2) of the data buffer belong to no tensor"},
      {"trailing bytes", file_bytes(R"({"a":)" + u8_4 + "[0,4]}}", zeros(9)),
       "the data buffer has 9 bytes but the tensors cover only 4"},
      {"duplicate tensor",
       file_bytes(R"({"a":)" + u8_4 + R"([0,4]},"a":)" + u8_4 + "[4,8]}}", zeros(8)),
       "duplicate key 'a'"},
      {"duplicate field",
       file_bytes(R"({"a":{"dtype":"U8","dtype":"U8","shape":[0],)"
                  R"("data_offsets":[0,0]}})"),
       "duplicate key 'dtype'"},
      {"duplicate metadata key", file_bytes(R"({"__metadata__":{"k":"1","k":"2"}})"),
       "duplicate key 'k'"},
      {"metadata not an object", file_bytes(R"({"__metadata__":"x"})"),
       "__metadata__ must be an object"},
      {"metadata value an array", file_bytes(R"({"__metadata__":{"k":[1]}})"),
       "__metadata__['k'] must be a string"},
      {"deep nesting", file_bytes(R"({"a":[[[[[[[[[[1]]]]]]]]]]})"), "nests deeper than 8"},
  };
}

TEST(SafeTensors, EveryMalformedFileIsRejectedWithItsReason) {
  for (const Malformed& m : malformed_files()) {
    SCOPED_TRACE(m.rule);
    EXPECT_ERROR(parse_safetensors(m.bytes), FormatError, m.message);
  }
}

// A valid file with several dtypes, an empty tensor and metadata.
Bytes sample_file() {
  SafeTensors f;
  f.tensors["query"] = patterned({2, 3}, DType::kBF16);
  f.tensors["kv_cache"] = patterned({2, 2, 2}, DType::kFp8E4M3);
  f.tensors["slots"] = patterned({3}, DType::kI64);
  f.tensors["empty"] = Tensor::empty({0}, DType::kI32);
  f.metadata = {{"num_heads", "3"}, {"scale", "0.5"}};
  return serialize_safetensors(f);
}

// Parses `bytes`; anything but success or FormatError fails the test.
void parse_expecting_format_error_or_success(const Bytes& bytes, const std::string& what) {
  try {
    parse_safetensors(bytes);
  } catch (const FormatError&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw something other than FormatError: " << e.what();
  }
}

TEST(SafeTensors, EveryTruncationIsAFormatError) {
  const Bytes full = sample_file();
  ASSERT_NO_THROW(parse_safetensors(full));
  for (size_t n = 0; n < full.size(); ++n) {
    const Bytes cut(full.begin(), full.begin() + std::ptrdiff_t(n));
    EXPECT_THROW(parse_safetensors(cut), FormatError) << "truncated to " << n << " bytes";
  }
}

TEST(SafeTensors, FlippedHeaderBytesNeverCrash) {
  const Bytes full = sample_file();
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | full[size_t(i)];
  for (size_t pos = 0; pos < 8 + header_len; ++pos) {
    for (uint8_t mask : {0x01, 0x02, 0x10, 0x20, 0x80, 0xff}) {
      Bytes b = full;
      b[pos] ^= mask;
      parse_expecting_format_error_or_success(b, "byte " + std::to_string(pos));
    }
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 2000; ++round) {
    Bytes b = full;
    for (int k = 0; k < 4; ++k) {
      b[rng() % (8 + header_len)] = uint8_t(rng());
    }
    parse_expecting_format_error_or_success(b, "round " + std::to_string(round));
  }
}

}  // namespace
}  // namespace pagedattn
