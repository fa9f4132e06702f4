#include "pagedattn/parallel.h"

#include <limits>

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

namespace {

void check_shard(const TensorParallelShard& s, int num_heads, int num_kv_heads) {
  const TensorParallelShard check =
      TensorParallelShard::of(num_heads, num_kv_heads, s.rank, s.world);
  require(check.head_begin == s.head_begin && check.num_heads == s.num_heads &&
              check.kv_head_begin == s.kv_head_begin && check.num_kv_heads == s.num_kv_heads,
          "the tensor-parallel shard was made for another head configuration (num_heads ",
          num_heads, ", num_kv_heads ", num_kv_heads, ")");
}

// The shard's entries of a per-query-head vector (ALiBi slopes, sinks); empty stays empty.
std::vector<float> head_slice(const std::vector<float>& v, int num_heads,
                              const TensorParallelShard& s, const char* name) {
  if (v.empty()) return v;
  require(int(v.size()) == num_heads, name, " has ", v.size(), " entries; num_heads is ",
          num_heads);
  return std::vector<float>(v.begin() + s.head_begin, v.begin() + s.head_begin + s.num_heads);
}

}  // namespace

AttentionOptions shard_options(const AttentionOptions& o, const TensorParallelShard& s) {
  check_shard(s, o.num_heads, o.num_kv_heads.value_or(o.num_heads));
  AttentionOptions r = o;
  r.num_heads = s.num_heads;
  r.num_kv_heads = s.num_kv_heads;
  r.alibi_slopes = head_slice(o.alibi_slopes, o.num_heads, s, "alibi_slopes");
  r.sinks = head_slice(o.sinks, o.num_heads, s, "sinks");
  return r;
}

AttentionConfig shard_config(const AttentionConfig& c, const TensorParallelShard& s) {
  check_shard(s, c.num_heads, c.num_kv_heads);
  AttentionConfig r = c;
  r.num_heads = s.num_heads;
  r.num_kv_heads = s.num_kv_heads;
  r.alibi_slopes = head_slice(c.alibi_slopes, c.num_heads, s, "alibi_slopes");
  r.sinks = head_slice(c.sinks, c.num_heads, s, "sinks");
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
  } else if (c.attn_type == AttentionType::kEncoderDecoder) {
    why.push_back("cross attention (encoder_decoder) keeps its encoder keys whole");
  }
  if (c.has_alibi()) why.push_back("ALiBi biases need global key positions");
  if (c.sliding_window) why.push_back("a sliding window needs global key positions");
  return why;
}

namespace {

void require_dcp_supported(const AttentionConfig& c) {
  const auto why = DecodeContextParallel::unsupported(c);
  std::string all;
  for (const auto& w : why) all += (all.empty() ? "" : "; ") + w;
  require(why.empty(), "decode context parallelism does not support this layer: ", all);
}

}  // namespace

AttentionConfig dcp_config(const AttentionConfig& c, const DecodeContextParallel& dcp) {
  require_dcp_supported(c);
  AttentionConfig r = c;
  if (dcp.rank != 0) r.sinks.clear();  // the sink joins the merged denominator once, via rank 0
  return r;
}

AttentionOptions dcp_options(const AttentionOptions& o, const DecodeContextParallel& dcp) {
  // The fields unsupported() reads, resolved as the layer resolves them (the per-layer window
  // wins over the cache config's).
  AttentionConfig probe;
  probe.attn_type = o.attn_type;
  probe.alibi_slopes = o.alibi_slopes;
  probe.sliding_window = o.per_layer_sliding_window
                             ? o.per_layer_sliding_window
                             : o.cache_config.value_or(CacheConfig{}).sliding_window;
  require_dcp_supported(probe);
  AttentionOptions r = o;
  if (dcp.rank != 0) r.sinks.clear();
  return r;
}

DcpStep dcp_step_metadata(const std::vector<DcpRequest>& requests, int block_size,
                          const DecodeContextParallel& dcp) {
  require(block_size >= 1, "dcp_step_metadata: block_size (", block_size, ") must be >= 1");
  MetadataBuilder b(block_size);
  std::vector<bool> owner;  // per row: this rank owns the row's new token
  DcpStep step;
  for (size_t r = 0; r < requests.size(); ++r) {
    const DcpRequest& req = requests[r];
    require(req.context_len >= 0 && req.num_new_tokens >= 0, "request ", r, ": context_len (",
            req.context_len, ") and num_new_tokens (", req.num_new_tokens, ") must be >= 0");
    const int64_t seq = int64_t(req.context_len) + req.num_new_tokens;
    const int64_t blocks = (dcp.local_len(seq) + block_size - 1) / block_size;
    require(int64_t(req.local_block_ids.size()) >= blocks, "request ", r, ": local_block_ids has ",
            req.local_block_ids.size(), " blocks; rank ", dcp.rank, " of ", dcp.world, " holds ",
            dcp.local_len(seq), " of its ", seq, " tokens and needs ", blocks);
    for (int i = 0; i < req.num_new_tokens; ++i) {
      const int64_t pos = int64_t(req.context_len) + i;
      const int64_t visible = dcp.local_len(pos + 1);  // local keys at global positions <= pos
      if (visible == 0) {
        // Valid metadata for a row with nothing to read here; its result is cleared later.
        step.empty_rows.push_back(int32_t(owner.size()));
        b.add(RequestSpec{0, 1, {0}});
      } else {
        // Its last visible local key is the row's own token when this rank owns it, an older
        // token otherwise; the causal mask of a one-row request shows exactly `visible` keys.
        const auto used = size_t((visible + block_size - 1) / block_size);
        b.add(RequestSpec{int(visible - 1), 1,
                          std::vector<int32_t>(req.local_block_ids.begin(),
                                               req.local_block_ids.begin() + long(used))});
      }
      owner.push_back(dcp.owns(pos));
    }
  }
  step.metadata = b.build();
  for (size_t row = 0; row < owner.size(); ++row) {
    if (!owner[row]) step.metadata.slot_mapping[row] = -1;
  }
  return step;
}

void dcp_clear_empty_rows(const DcpStep& step, const TensorView& output, const TensorView& lse) {
  require(lse.defined() && lse.ndim == 2 && lse.dtype == DType::kF32,
          "dcp_clear_empty_rows: lse must be float32 [num_heads, num_tokens]; got ", describe(lse));
  require(output.defined() && (output.ndim == 2 || output.ndim == 3),
          "dcp_clear_empty_rows: output must be [T, H, D] or [T, H*D]; got ", describe(output));
  const auto neg_inf = -std::numeric_limits<double>::infinity();
  for (const int32_t row : step.empty_rows) {
    require(row < output.size(0) && row < lse.size(1), "dcp_clear_empty_rows: empty row ", row,
            " is past the output (", output.size(0), " rows) or the lse (", lse.size(1),
            " columns)");
    const TensorView out_row = output.select(0, row);
    if (output.device.is_cpu()) {
      fill_host(out_row, 0.0);
    } else {
      require(out_row.is_contiguous(), "dcp_clear_empty_rows: output row ", row, " on ",
              to_string(output.device), " is not contiguous");
      Tensor zeros = Tensor::zeros(out_row.shape_vector(), out_row.dtype);
      copy_tensor(out_row, zeros.view());
    }
    for (int64_t h = 0; h < lse.size(0); ++h) {
      const TensorView cell = lse.select(0, h).slice(0, row, row + 1);
      if (lse.device.is_cpu()) {
        fill_host(cell, neg_inf);
      } else {
        Tensor one = Tensor::empty({1}, DType::kF32);
        fill_host(one.view(), neg_inf);
        copy_tensor(cell, one.view());
      }
    }
  }
}

StepMetadata dcp_decode_metadata(const std::vector<DcpDecodeRequest>& requests, int block_size,
                                 const DecodeContextParallel& dcp) {
  std::vector<DcpRequest> step;
  for (size_t r = 0; r < requests.size(); ++r) {
    const int64_t seq = int64_t(requests[r].context_len) + 1;
    require(dcp.local_len(seq) >= 1, "request ", r, ": a sequence of ", seq, " tokens leaves rank ",
            dcp.rank, " of ", dcp.world,
            " without keys; decode context parallelism needs >= ", dcp.world,
            " tokens per request");
    step.push_back(DcpRequest{requests[r].context_len, 1, requests[r].local_block_ids});
  }
  return dcp_step_metadata(step, block_size, dcp).metadata;
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
