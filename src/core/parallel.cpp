#include "pagedattn/parallel.h"

#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

TensorParallelShard TensorParallelShard::of(int num_heads, int num_kv_heads, int rank, int world) {
  require(world >= 1, "tensor-parallel world size (", world, ") must be >= 1");
  require(rank >= 0 && rank < world, "tensor-parallel rank (", rank, ") must be in [0, ", world,
          ")");
  require(num_heads > 0 && num_heads % world == 0, "num_heads (", num_heads,
          ") must be divisible by the tensor-parallel world size (", world, ")");
  require(num_kv_heads > 0 && (num_kv_heads % world == 0 || world % num_kv_heads == 0),
          "num_kv_heads (", num_kv_heads,
          ") must divide or be divisible by the tensor-parallel "
          "world size (",
          world, ")");
  require(num_heads % num_kv_heads == 0, "num_heads (", num_heads,
          ") must be divisible by num_kv_heads (", num_kv_heads, ")");
  TensorParallelShard s;
  s.rank = rank;
  s.world = world;
  s.num_heads = num_heads / world;
  s.head_begin = rank * s.num_heads;
  if (num_kv_heads >= world) {
    s.num_kv_heads = num_kv_heads / world;
    s.kv_head_begin = rank * s.num_kv_heads;
  } else {
    s.num_kv_heads = 1;
    s.kv_head_begin = rank / (world / num_kv_heads);  // world / num_kv_heads ranks per KV head
  }
  return s;
}

AttentionOptions shard_options(const AttentionOptions& o, const TensorParallelShard& s) {
  const int kv = o.num_kv_heads.value_or(o.num_heads);
  const TensorParallelShard check = TensorParallelShard::of(o.num_heads, kv, s.rank, s.world);
  require(check.head_begin == s.head_begin && check.num_heads == s.num_heads &&
              check.kv_head_begin == s.kv_head_begin && check.num_kv_heads == s.num_kv_heads,
          "shard_options: the shard was made for another head configuration");
  AttentionOptions r = o;
  r.num_heads = s.num_heads;
  r.num_kv_heads = s.num_kv_heads;
  auto slice = [&](const std::vector<float>& v, const char* name) {
    if (v.empty()) return v;
    require(int(v.size()) == o.num_heads, name, " has ", v.size(), " entries; num_heads is ",
            o.num_heads);
    return std::vector<float>(v.begin() + s.head_begin, v.begin() + s.head_begin + s.num_heads);
  };
  r.alibi_slopes = slice(o.alibi_slopes, "alibi_slopes");
  r.sinks = slice(o.sinks, "sinks");
  return r;
}

namespace {

TensorView head_range(const TensorView& v, int begin, int count, int total, int head_size,
                      const char* name) {
  require(v.defined(), name, " is required");
  if (v.ndim == 3) {
    require(v.size(1) == total && v.size(2) == head_size, name, " must be [T, ", total, ", ",
            head_size, "]; got ", describe(v));
    return v.slice(1, begin, begin + count);
  }
  require(v.ndim == 2 && v.size(1) == int64_t(total) * head_size, name, " must be [T, ", total, "*",
          head_size, "]; got ", describe(v));
  return v.slice(1, int64_t(begin) * head_size, int64_t(begin + count) * head_size);
}

}  // namespace

TensorView shard_query(const TensorView& q, const TensorParallelShard& s, int head_size) {
  return head_range(q, s.head_begin, s.num_heads, s.num_heads * s.world, head_size, "query");
}

TensorView shard_kv(const TensorView& kv, const TensorParallelShard& s, int head_size) {
  const int total_kv = kv.ndim == 3 ? int(kv.size(1)) : int(kv.size(1) / head_size);
  return head_range(kv, s.kv_head_begin, s.num_kv_heads, total_kv, head_size, "key/value");
}

DecodeContextParallel DecodeContextParallel::of(int rank, int world) {
  require(world >= 1, "decode-context-parallel world size (", world, ") must be >= 1");
  require(rank >= 0 && rank < world, "decode-context-parallel rank (", rank, ") must be in [0, ",
          world, ")");
  return DecodeContextParallel{rank, world};
}

std::vector<std::string> DecodeContextParallel::unsupported(const AttentionConfig& c) {
  std::vector<std::string> why;
  if (!uses_kv_cache(c.attn_type)) {
    why.push_back(detail::cat(to_string(c.attn_type), " attention has no KV cache to spread"));
  }
  if (c.has_alibi()) why.push_back("ALiBi biases need global key positions");
  if (c.sliding_window) why.push_back("a sliding window needs global key positions");
  if (c.has_sinks()) why.push_back("sinks must join the denominator once, after the merge");
  return why;
}

StepMetadata dcp_decode_metadata(const std::vector<DcpDecodeRequest>& requests, int block_size,
                                 const DecodeContextParallel& dcp) {
  MetadataBuilder b(block_size);
  std::vector<bool> owner;
  for (size_t r = 0; r < requests.size(); ++r) {
    const int64_t seq = int64_t(requests[r].context_len) + 1;
    const int64_t local = dcp.local_len(seq);
    require(local >= 1, "request ", r, ": a sequence of ", seq, " tokens leaves rank ", dcp.rank,
            " of ", dcp.world, " without keys; decode context parallelism needs >= ", dcp.world,
            " tokens per request");
    // The query is the last local position: it sees every local key, as it sees every global
    // one (they all precede it).
    b.add(RequestSpec{int(local - 1), 1, requests[r].local_block_ids});
    owner.push_back(dcp.owns(seq - 1));
  }
  StepMetadata md = b.build();
  for (size_t r = 0; r < owner.size(); ++r) {
    if (!owner[r]) md.slot_mapping[r] = -1;  // that rank's last local key is an old token
  }
  return md;
}

void dcp_prefill_slots(int num_tokens, const std::vector<int32_t>& ids, int block_size,
                       const DecodeContextParallel& dcp, std::vector<int64_t>& slots) {
  for (int p = 0; p < num_tokens; ++p) {
    if (!dcp.owns(p)) {
      slots.push_back(-1);
      continue;
    }
    const int64_t local = dcp.local_pos(p);
    const int64_t block = local / block_size;
    require(block < int64_t(ids.size()), "dcp_prefill_slots: local position ", local,
            " needs block ", block, " but only ", ids.size(), " local blocks were given");
    slots.push_back(int64_t(ids[size_t(block)]) * block_size + local % block_size);
  }
}

}  // namespace pagedattn
