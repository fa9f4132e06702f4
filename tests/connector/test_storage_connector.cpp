// The storage connector: round trips through the worker hooks (NHD, HND, fp8 with scales),
// the file format, the scheduler-side lookups and per-step plans, and every failure: torn,
// truncated, corrupted, mismatched and future-version entries are rejected without touching
// the cache; a writer killed mid-write leaves no entry; concurrent writers of one block; a
// layer never saved; an unwritable directory.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <thread>

#include "common/expect_error.h"
#include "connector/kv_entry.h"
#include "connector_test_util.h"
#include "pagedattn/safetensors.h"

namespace pagedattn {
namespace {

using connector::BlockTransfer;
using connector::BlockTransferMetadata;
using testing::Model;
using testing::ModelShape;
using testing::run_worker_step;
using testing::TempDir;
using testing::tokens;
using testing::transfer_of;

constexpr uint8_t kPoison = 0x3c;

std::string entry_path(const KVConnectorConfig& c, uint64_t hash) {
  const std::string h = connector::hex64(hash);
  return c.address + "/pagedattn-kv-v1/" + c.namespace_name() + "/" + h.substr(0, 2) + "/" + h +
         ".safetensors";
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Saves `num_blocks` blocks of `prompt` from physical blocks `from` of a random-filled model.
struct Saved {
  std::vector<int32_t> prompt;
  std::vector<BlockTransfer> transfers;  // as saved (physical blocks of the source model)
};
Saved save_blocks(Model& source, const KVConnectorConfig& config, const std::vector<int32_t>& from,
                  int salt = 0) {
  Saved s;
  s.prompt = tokens(int(from.size()) * source.shape().block_size + 1, salt);
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  auto meta = std::make_shared<BlockTransferMetadata>();
  for (size_t j = 0; j < from.size(); ++j) {
    meta->saves.push_back(transfer_of(s.prompt, source.shape().block_size, int(j), from[j]));
  }
  s.transfers = meta->saves;
  EXPECT_TRUE(run_worker_step(source, *worker, meta).empty());
  worker->flush();
  const KVConnectorStats st = worker->stats();
  EXPECT_EQ(st.saved_blocks, int64_t(from.size()));
  EXPECT_EQ(st.save_errors, 0);
  return s;
}

// Loads `saved` into physical blocks `into` of `target`; returns the failed blocks.
std::vector<int32_t> load_blocks(Model& target, const KVConnectorConfig& config, const Saved& saved,
                                 const std::vector<int32_t>& into,
                                 KVConnectorStats* stats = nullptr) {
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  auto meta = std::make_shared<BlockTransferMetadata>();
  for (size_t j = 0; j < into.size(); ++j) {
    BlockTransfer t = saved.transfers[j];
    t.block_ids = {into[j]};
    meta->loads.push_back(t);
  }
  std::vector<int32_t> errors = run_worker_step(target, *worker, meta);
  if (stats) *stats = worker->stats();
  return errors;
}

struct LayoutCase {
  KVCacheLayout source, target;
};
class StorageRoundTrip : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(StorageRoundTrip, LoadedBlocksEqualSavedOnes) {
  TempDir dir;
  ModelShape shape;
  shape.layout = GetParam().source;
  Model source(shape);
  source.fill_random(1);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {5, 9, 2});

  shape.layout = GetParam().target;
  Model target(shape);
  target.fill(kPoison);
  KVConnectorStats st;
  EXPECT_TRUE(
      load_blocks(target, target.connector_config("storage:" + dir.path()), saved, {3, 4, 7}, &st)
          .empty());
  EXPECT_EQ(st.loaded_blocks, 3);
  EXPECT_EQ(st.rejected_blocks, 0);
  EXPECT_EQ(st.loaded_bytes, 3 * 3 * int64_t(2 * 4 * 2 * 8 * 2));
  const std::vector<uint8_t> poison(size_t(2 * 4 * 2 * 8 * 2), kPoison);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(target.block(l, 3), source.block(l, 5)) << "layer " << l;
    EXPECT_EQ(target.block(l, 4), source.block(l, 9)) << "layer " << l;
    EXPECT_EQ(target.block(l, 7), source.block(l, 2)) << "layer " << l;
    EXPECT_EQ(target.block(l, 5), poison) << "other blocks untouched";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, StorageRoundTrip,
                         ::testing::Values(LayoutCase{KVCacheLayout::kNHD, KVCacheLayout::kNHD},
                                           LayoutCase{KVCacheLayout::kHND, KVCacheLayout::kHND},
                                           LayoutCase{KVCacheLayout::kHND, KVCacheLayout::kNHD},
                                           LayoutCase{KVCacheLayout::kNHD, KVCacheLayout::kHND}));

TEST(StorageRoundTrip, LoadsInWavesWhenStagingIsSmall) {
  TempDir dir;
  ModelShape shape;
  shape.num_kv_heads = 8;
  shape.head_size = 128;
  shape.block_size = 64;  // 256 KiB per layer and block, 768 KiB per entry
  shape.num_blocks = 12;
  Model source(shape);
  source.fill_random(12);
  const Saved saved =
      save_blocks(source, source.connector_config("storage:" + dir.path()), {1, 2, 3, 4, 5});
  Model target(shape);
  KVConnectorStats st;
  // 1 MiB of staging: waves of two entries.
  EXPECT_TRUE(
      load_blocks(target,
                  target.connector_config("storage:" + dir.path() + "?max_load_staging_mb=1"),
                  saved, {11, 10, 9, 8, 7}, &st)
          .empty());
  EXPECT_EQ(st.loaded_blocks, 5);
  for (int l = 0; l < 3; ++l) {
    for (int j = 0; j < 5; ++j) EXPECT_EQ(target.block(l, 11 - j), source.block(l, 1 + j));
  }
}

TEST(StorageFormat, AnEntryIsAStandardSafetensorsFile) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  source.fill_random(2);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {6, 1});
  const SafeTensors f = load_safetensors(entry_path(config, saved.transfers[1].hash));
  ASSERT_EQ(f.tensors.size(), 3u);
  for (int l = 0; l < 3; ++l) {
    const Tensor* t = f.find(source.name(l));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->view().shape_vector(), (std::vector<int64_t>{2, 4, 2, 8}));
    EXPECT_EQ(t->view().dtype, DType::kBF16);
    const std::vector<uint8_t> want = source.block(l, 1);
    EXPECT_EQ(std::vector<uint8_t>(static_cast<const uint8_t*>(t->data()),
                                   static_cast<const uint8_t*>(t->data()) + want.size()),
              want);
  }
  auto meta = [&f](const char* key) { return f.find_metadata(key) ? *f.find_metadata(key) : ""; };
  EXPECT_EQ(meta("format"), "pagedattn.kv_block");
  EXPECT_EQ(meta("format_version"), "1");
  EXPECT_EQ(meta("namespace"), "test-model/auto-bfloat16/L3-H2-D8-B4");
  EXPECT_EQ(meta("model"), "test-model");
  EXPECT_EQ(meta("block_hash"), connector::hex64(saved.transfers[1].hash));
  EXPECT_EQ(meta("parent_hash"), connector::hex64(saved.transfers[0].hash));
  EXPECT_EQ(meta("token_ids"), "4,5,6,7");
  EXPECT_EQ(meta("block_size"), "4");
  EXPECT_EQ(meta("num_kv_heads"), "2");
  EXPECT_EQ(meta("head_size"), "8");
  EXPECT_EQ(meta("num_layers"), "3");
  EXPECT_EQ(meta("kv_cache_dtype"), "auto");
  EXPECT_EQ(meta("dtype"), "BF16");
  EXPECT_EQ(meta("layout"), "NHD");
  EXPECT_EQ(meta("crc32c").size(), 3u * 8 + 2);
  // No temporary file is left behind.
  size_t files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path())) {
    if (e.is_regular_file()) {
      ++files;
      EXPECT_EQ(e.path().extension(), ".safetensors") << e.path();
    }
  }
  EXPECT_EQ(files, 2u);
}

// Scheduler side: lookups count leading stored blocks past the local hit, leave one token to
// compute, and the per-step plan loads and saves the right blocks.
TEST(StorageScheduler, LookupsAndPlans) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  source.fill_random(3);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {5, 9, 2});  // prompt of 13 tokens, 3 blocks
  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);

  KVConnectorRequest r;
  r.request_id = 7;
  r.token_ids = saved.prompt;
  r.num_prompt_tokens = 13;
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 0).num_tokens, 12);
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 4).num_tokens, 8);
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 12).num_tokens, 0);
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 2).num_tokens, 0) << "unaligned: no load";
  // A prompt of exactly 12 tokens keeps its last token to compute: 2 blocks.
  const std::vector<int32_t> twelve(saved.prompt.begin(), saved.prompt.begin() + 12);
  KVConnectorRequest r12 = r;
  r12.token_ids = twelve;
  r12.num_prompt_tokens = 12;
  EXPECT_EQ(sched->get_num_new_matched_tokens(r12, 0).num_tokens, 8);
  // Another prompt: nothing stored.
  const std::vector<int32_t> other = tokens(13, 9);
  KVConnectorRequest ro = r;
  ro.request_id = 8;
  ro.token_ids = other;
  EXPECT_EQ(sched->get_num_new_matched_tokens(ro, 0).num_tokens, 0);

  // Allocation and the step plan: request 7 loads blocks 1..2 after a local hit of block 0.
  r.num_computed_tokens = 4;
  const std::vector<std::vector<int32_t>> table = {{11, 12, 13, 14}};
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 4).num_tokens, 8);
  sched->update_state_after_alloc(r, table, 8);
  ro.num_computed_tokens = 0;
  const std::vector<std::vector<int32_t>> table_o = {{21, 22, 23, 24}};
  EXPECT_EQ(sched->get_num_new_matched_tokens(ro, 0).num_tokens, 0);
  sched->update_state_after_alloc(ro, table_o, 0);
  KVConnectorSchedulerOutput out;
  out.requests.push_back({r, table, 12, 1});
  out.requests.push_back({ro, table_o, 0, 13});
  auto meta =
      std::dynamic_pointer_cast<const BlockTransferMetadata>(sched->build_connector_meta(out));
  ASSERT_NE(meta, nullptr);
  ASSERT_EQ(meta->loads.size(), 2u);
  EXPECT_EQ(meta->loads[0].block_index, 1);
  EXPECT_EQ(meta->loads[0].block_ids, std::vector<int32_t>{12});
  EXPECT_EQ(meta->loads[0].hash, saved.transfers[1].hash);
  EXPECT_EQ(meta->loads[1].block_ids, std::vector<int32_t>{13});
  // kBoth saves the other request's full prompt blocks (3 of its 13 tokens' blocks).
  ASSERT_EQ(meta->saves.size(), 3u);
  EXPECT_EQ(meta->saves[0].request_id, 8);
  EXPECT_EQ(meta->saves[2].block_ids, std::vector<int32_t>{23});
  const KVConnectorStats st = sched->stats();
  EXPECT_EQ(st.lookups, 2);
  EXPECT_EQ(st.hit_blocks, 2);
  EXPECT_EQ(st.miss_blocks, 3);
  EXPECT_EQ(st.save_scheduled, 3);
  // The next step plans nothing new for them.
  out.requests[0].num_computed_tokens = 13;
  out.requests[1].num_computed_tokens = 13;
  meta = std::dynamic_pointer_cast<const BlockTransferMetadata>(sched->build_connector_meta(out));
  EXPECT_TRUE(meta->loads.empty());
  EXPECT_TRUE(meta->saves.empty());
  // A failed load is saved again once recomputed (the store is repaired).
  sched->update_state_after_alloc(r, table, 8);
  out.requests[0].num_computed_tokens = 12;
  meta = std::dynamic_pointer_cast<const BlockTransferMetadata>(sched->build_connector_meta(out));
  ASSERT_EQ(meta->loads.size(), 2u);
  const std::vector<int32_t> failed = {13};
  sched->update_connector_output(failed);
  out.requests[0].num_computed_tokens = 8;
  out.requests[0].num_new_tokens = 5;
  meta = std::dynamic_pointer_cast<const BlockTransferMetadata>(sched->build_connector_meta(out));
  ASSERT_EQ(meta->saves.size(), 1u);
  EXPECT_EQ(meta->saves[0].block_index, 2);
}

TEST(StorageScheduler, RolesLimitLoadsAndSaves) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  const Saved saved = save_blocks(source, source.connector_config("storage:" + dir.path()), {1, 2});
  KVConnectorRequest r;
  r.request_id = 1;
  r.token_ids = saved.prompt;
  r.num_prompt_tokens = int(saved.prompt.size());
  const std::vector<std::vector<int32_t>> table = {{3, 4, 5}};
  KVConnectorSchedulerOutput out;
  out.requests.push_back({r, table, 0, 9});
  // A producer never loads; a consumer never saves.
  auto producer =
      make_kv_connector(source.connector_config("storage:" + dir.path(), KVTransferRole::kProducer),
                        KVConnectorRole::kScheduler);
  EXPECT_EQ(producer->get_num_new_matched_tokens(r, 0).num_tokens, 0);
  auto consumer =
      make_kv_connector(source.connector_config("storage:" + dir.path(), KVTransferRole::kConsumer),
                        KVConnectorRole::kScheduler);
  EXPECT_EQ(consumer->get_num_new_matched_tokens(r, 0).num_tokens, 8);
  const std::vector<int32_t> other = tokens(9, 5);
  out.requests[0].request.token_ids = other;
  out.requests[0].request.request_id = 2;
  auto meta =
      std::dynamic_pointer_cast<const BlockTransferMetadata>(consumer->build_connector_meta(out));
  EXPECT_TRUE(meta->saves.empty());
  meta =
      std::dynamic_pointer_cast<const BlockTransferMetadata>(producer->build_connector_meta(out));
  EXPECT_EQ(meta->saves.size(), 2u);
}

// Every kind of bad entry is rejected: the cache block keeps its bytes, the block is reported
// as a load error, and the good entries of the same step still load.
struct Corruption {
  const char* name;
  std::function<void(std::vector<uint8_t>&)> apply;
  const char* reason;  // in the log message
};

void replace_in_header(std::vector<uint8_t>& bytes, const std::string& from,
                       const std::string& to) {
  ASSERT_EQ(from.size(), to.size());
  std::string text(bytes.begin(), bytes.end());
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  std::copy(to.begin(), to.end(), bytes.begin() + ptrdiff_t(at));
}

class StorageRejects : public ::testing::TestWithParam<Corruption> {};

TEST_P(StorageRejects, BadEntryIsAMissNeverReadIntoTheCache) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  source.fill_random(4);
  KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {5, 9, 2});
  const std::string victim = entry_path(config, saved.transfers[1].hash);
  std::vector<uint8_t> bytes = read_file(victim);
  GetParam().apply(bytes);
  write_file(victim, bytes);

  Model target(shape);
  target.fill(kPoison);
  std::vector<std::string> logs;
  KVConnectorConfig target_config = target.connector_config("storage:" + dir.path());
  target_config.log = [&logs](std::string_view m) { logs.emplace_back(m); };
  KVConnectorStats st;
  const std::vector<int32_t> errors = load_blocks(target, target_config, saved, {3, 4, 7}, &st);
  EXPECT_EQ(errors, std::vector<int32_t>{4});
  EXPECT_EQ(st.rejected_blocks, 1);
  EXPECT_EQ(st.loaded_blocks, 2);
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_THAT(logs[0], ::testing::HasSubstr(GetParam().reason));
  EXPECT_THAT(logs[0], ::testing::HasSubstr("the block is recomputed"));
  const std::vector<uint8_t> poison(size_t(2 * 4 * 2 * 8 * 2), kPoison);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(target.block(l, 4), poison) << "layer " << l << " of the rejected block";
    EXPECT_EQ(target.block(l, 3), source.block(l, 5));
    EXPECT_EQ(target.block(l, 7), source.block(l, 2));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Failures, StorageRejects,
    ::testing::Values(
        Corruption{"truncated", [](std::vector<uint8_t>& b) { b.resize(b.size() / 2); },
                   "(truncated)"},
        Corruption{"trailing_bytes", [](std::vector<uint8_t>& b) { b.push_back(0); },
                   "(trailing bytes)"},
        Corruption{"empty", [](std::vector<uint8_t>& b) { b.clear(); }, "only 0 bytes"},
        Corruption{"torn_last_layer",  // the tail of the data was never written: zeros
                   [](std::vector<uint8_t>& b) { std::fill(b.end() - 100, b.end(), uint8_t(0)); },
                   "CRC-32C is"},
        Corruption{"bit_flip_in_data", [](std::vector<uint8_t>& b) { b[b.size() - 300] ^= 0x10; },
                   "CRC-32C is"},
        Corruption{"garbage",
                   [](std::vector<uint8_t>& b) { std::fill(b.begin(), b.end(), uint8_t(0xab)); },
                   "does not fit"},
        Corruption{"header_not_json", [](std::vector<uint8_t>& b) { b[8] = '['; },
                   "not valid JSON"},
        Corruption{"other_block_size",
                   [](std::vector<uint8_t>& b) {
                     replace_in_header(b, "\"block_size\":\"4\"", "\"block_size\":\"8\"");
                   },
                   "field block_size is '8', expected '4'"},
        Corruption{"other_tokens",  // a hash collision: same key, other tokens
                   [](std::vector<uint8_t>& b) {
                     replace_in_header(b, "\"token_ids\":\"4,", "\"token_ids\":\"9,");
                   },
                   "field token_ids"},
        Corruption{"other_dtype",
                   [](std::vector<uint8_t>& b) {
                     replace_in_header(b, "\"dtype\":\"BF16\",\"format\"",
                                       "\"dtype\":\"F16\" ,\"format\"");
                   },
                   "field dtype is 'F16', expected 'BF16'"},
        Corruption{"other_tensor_shape",
                   [](std::vector<uint8_t>& b) {
                     replace_in_header(b, "\"shape\":[2,4,2,8]", "\"shape\":[2,4,8,2]");
                   },
                   "shape is [2,4,8,2], expected [2, 4, 2, 8]"},
        Corruption{"future_version",
                   [](std::vector<uint8_t>& b) {
                     replace_in_header(b, "\"format_version\":\"1\"", "\"format_version\":\"2\"");
                   },
                   "format_version is 2, this build reads 1"}),
    [](const ::testing::TestParamInfo<Corruption>& p) { return std::string(p.param.name); });

TEST(StorageRejects, AnotherBlocksEntryUnderThisKey) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  source.fill_random(5);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {5, 9});
  std::filesystem::copy_file(entry_path(config, saved.transfers[1].hash),
                             entry_path(config, saved.transfers[0].hash),
                             std::filesystem::copy_options::overwrite_existing);
  Model target(shape);
  KVConnectorStats st;
  EXPECT_EQ(load_blocks(target, config, saved, {3, 4}, &st), std::vector<int32_t>{3});
  EXPECT_EQ(st.rejected_blocks, 1);
}

TEST(StorageRejects, Fp8ScalesMustMatch) {
  TempDir dir;
  ModelShape shape;
  shape.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  shape.dtype = DType::kF32;
  Model source(shape);
  for (int l = 0; l < 3; ++l) source.layer(l).load_kv_scales(0.5f, 0.25f, 0.125f);
  source.fill_random(6);
  KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {5, 9});
  {
    Model same(shape);
    for (int l = 0; l < 3; ++l) same.layer(l).load_kv_scales(0.5f, 0.25f, 0.125f);
    KVConnectorStats st;
    EXPECT_TRUE(load_blocks(same, config, saved, {3, 4}, &st).empty());
    EXPECT_EQ(same.block(2, 4), source.block(2, 9));
  }
  Model other(shape);
  for (int l = 0; l < 3; ++l) other.layer(l).load_kv_scales(0.5f, 0.5f, 0.125f);
  std::vector<std::string> logs;
  config.log = [&logs](std::string_view m) { logs.emplace_back(m); };
  KVConnectorStats st;
  EXPECT_EQ(load_blocks(other, config, saved, {3, 4}, &st).size(), 2u);
  EXPECT_EQ(st.rejected_blocks, 2);
  ASSERT_FALSE(logs.empty());
  EXPECT_THAT(logs[0], ::testing::HasSubstr("field k_scales is '0x1p-2,0x1p-2,0x1p-2', expected "
                                            "'0x1p-1,0x1p-1,0x1p-1'"));
}

// Per-head scales are part of an entry's identity: an entry saved under other head scales
// (even with the same per-tensor floats) is rejected, never loaded as if they matched.
TEST(StorageRejects, PerHeadScalesMustMatch) {
  TempDir dir;
  ModelShape shape;
  shape.kv_cache_dtype = KVCacheDType::kFp8E4M3;
  shape.dtype = DType::kF32;
  Model source(shape);
  for (int l = 0; l < 3; ++l) source.layer(l).load_kv_scales({}, {0.5f, 0.25f}, {1.0f, 2.0f});
  source.fill_random(6);
  KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const Saved saved = save_blocks(source, config, {5, 9});
  {
    Model same(shape);
    for (int l = 0; l < 3; ++l) same.layer(l).load_kv_scales({}, {0.5f, 0.25f}, {1.0f, 2.0f});
    KVConnectorStats st;
    EXPECT_TRUE(load_blocks(same, config, saved, {3, 4}, &st).empty());
    EXPECT_EQ(same.block(2, 4), source.block(2, 9));
  }
  Model other(shape);
  for (int l = 0; l < 3; ++l) other.layer(l).load_kv_scales({}, {0.5f, 0.5f}, {1.0f, 2.0f});
  std::vector<std::string> logs;
  config.log = [&logs](std::string_view m) { logs.emplace_back(m); };
  KVConnectorStats st;
  EXPECT_EQ(load_blocks(other, config, saved, {3, 4}, &st).size(), 2u);
  EXPECT_EQ(st.rejected_blocks, 2);
  ASSERT_FALSE(logs.empty());
  EXPECT_THAT(logs[0], ::testing::HasSubstr("field k_scales is '[0x1p-1;0x1p-2],"));
}

TEST(StorageFailures, MissingEntriesAreMissesNotRejections) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  Saved saved = save_blocks(source, config, {5, 9});
  std::filesystem::remove(entry_path(config, saved.transfers[0].hash));  // evicted by someone
  Model target(shape);
  KVConnectorStats st;
  EXPECT_EQ(load_blocks(target, config, saved, {3, 4}, &st), std::vector<int32_t>{3});
  EXPECT_EQ(st.missing_blocks, 1);
  EXPECT_EQ(st.rejected_blocks, 0);
  EXPECT_EQ(st.loaded_blocks, 1);
}

// A writer killed in the middle of a save (the process gets SIGKILL half-way through writing
// an entry) leaves a temporary file no reader opens: the entry is a miss, the ones committed
// before it load.
TEST(StorageFailures, WriterKilledMidWriteLeavesNoEntry) {
  TempDir dir;
  ModelShape shape;
  const std::vector<int32_t> prompt = tokens(13);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child: a producer whose second write dies half-way.
    Model source(shape);
    source.fill_random(7);
    auto worker =
        make_kv_connector(source.connector_config("storage:" + dir.path() +
                                                  "?fault=crash-during-write:2&io_threads=1"),
                          KVConnectorRole::kWorker);
    auto meta = std::make_shared<BlockTransferMetadata>();
    for (int j = 0; j < 3; ++j) meta->saves.push_back(transfer_of(prompt, 4, j, 5 + j));
    run_worker_step(source, *worker, meta);
    worker->flush();
    ::_exit(0);  // not reached: the hook kills the process
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child should have been killed";
  EXPECT_EQ(WTERMSIG(status), SIGKILL);

  Model target(shape);
  const KVConnectorConfig config = target.connector_config("storage:" + dir.path());
  size_t entries = 0, temporaries = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path())) {
    if (!e.is_regular_file()) continue;
    (e.path().string().find(".tmp.") != std::string::npos ? temporaries : entries)++;
  }
  EXPECT_EQ(entries, 1u);
  EXPECT_EQ(temporaries, 1u);
  auto sched = make_kv_connector(config, KVConnectorRole::kScheduler);
  KVConnectorRequest r;
  r.request_id = 1;
  r.token_ids = prompt;
  r.num_prompt_tokens = 13;
  EXPECT_EQ(sched->get_num_new_matched_tokens(r, 0).num_tokens, 4) << "only block 0 committed";
  Saved saved;
  saved.prompt = prompt;
  for (int j = 0; j < 3; ++j) saved.transfers.push_back(transfer_of(prompt, 4, j, 0));
  KVConnectorStats st;
  EXPECT_EQ(load_blocks(target, config, saved, {3, 4, 7}, &st), (std::vector<int32_t>{4, 7}));
  EXPECT_EQ(st.loaded_blocks, 1);
  EXPECT_EQ(st.missing_blocks, 2);
  EXPECT_EQ(st.rejected_blocks, 0);
}

TEST(StorageFailures, ConcurrentWritersOfOneBlock) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  source.fill_random(8);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  const std::vector<int32_t> prompt = tokens(5);
  // Four engines save the same block at once (their own copies of the same data).
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<Model>> models;
  for (int i = 0; i < 4; ++i) {
    models.push_back(std::make_unique<Model>(shape));
    models.back()->fill_random(8);
  }
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
      auto meta = std::make_shared<BlockTransferMetadata>();
      meta->saves.push_back(transfer_of(prompt, 4, 0, 6));
      run_worker_step(*models[size_t(i)], *worker, meta);
    });
  }
  for (std::thread& t : threads) t.join();
  size_t files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path())) {
    files += e.is_regular_file() ? 1 : 0;
  }
  EXPECT_EQ(files, 1u) << "one entry, no temporary files";
  Saved saved;
  saved.prompt = prompt;
  saved.transfers.push_back(transfer_of(prompt, 4, 0, 0));
  Model target(shape);
  EXPECT_TRUE(load_blocks(target, config, saved, {2}).empty());
  EXPECT_EQ(target.block(1, 2), source.block(1, 6));
}

TEST(StorageFailures, AnEntryMissingALayerIsNeverWritten) {
  TempDir dir;
  ModelShape shape;
  Model source(shape);
  const KVConnectorConfig config = source.connector_config("storage:" + dir.path());
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  auto meta = std::make_shared<BlockTransferMetadata>();
  meta->saves.push_back(transfer_of(tokens(5), 4, 0, 6));
  ForwardContext& ctx = source.context();
  ctx.set_kv_connector(worker.get());
  worker->bind_connector_metadata(meta);
  StepMetadata step = testing::one_request_step(4, 1, {1});
  AttentionMetadata md = step.view();
  ctx.begin_step({&md});
  for (int i = 0; i < 2; ++i) {  // layer 2 never runs (an exception in the model, say)
    worker->save_kv_layer(source.name(i), source.cache(i), md, {});
  }
  ctx.end_step();
  worker->clear_connector_metadata();
  worker->flush();
  EXPECT_EQ(worker->stats().saved_blocks, 0);
  EXPECT_EQ(worker->stats().save_dropped, 1);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/pagedattn-kv-v1"));
}

TEST(StorageFailures, UnwritableDirectoryCountsErrors) {
  TempDir dir;
  write_file(dir.path() + "/file", {1});
  ModelShape shape;
  Model source(shape);
  KVConnectorConfig config = source.connector_config("storage:" + dir.path() + "/file/kv");
  std::vector<std::string> logs;
  config.log = [&logs](std::string_view m) { logs.emplace_back(m); };
  auto worker = make_kv_connector(config, KVConnectorRole::kWorker);
  auto meta = std::make_shared<BlockTransferMetadata>();
  meta->saves.push_back(transfer_of(tokens(5), 4, 0, 6));
  run_worker_step(source, *worker, meta);
  worker->flush();
  EXPECT_EQ(worker->stats().save_errors, 1);
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_THAT(logs[0], ::testing::HasSubstr("cannot save entry"));
  EXPECT_THAT(logs[0], ::testing::HasSubstr("cannot create"));
}

}  // namespace
}  // namespace pagedattn
