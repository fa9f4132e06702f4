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

}  // namespace pagedattn
