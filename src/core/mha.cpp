#include "pagedattn/mha.h"

#include "core/head_pad.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/error.h"

namespace pagedattn {

using detail::require;

namespace {

// [B, S, H*D] or [B, S, H, D] -> [B*S, H, D] (the rows must be evenly strided across batch
// elements, which every dense tensor is).
TensorView as_rows(const TensorView& v, std::string_view name, int heads, int head_size) {
  require(v.defined(), name, " is required");
  require(v.ndim == 3 || v.ndim == 4, name, " must be [batch, seq, ", heads, "*", head_size,
          "] or [batch, seq, ", heads, ", ", head_size, "]; got ", describe(v));
  const int64_t b = v.size(0), s = v.size(1);
  int64_t head_stride = 0, elem_stride = 0;
  if (v.ndim == 3) {
    require(v.size(2) == int64_t(heads) * head_size, name, " must be [batch, seq, ", heads, "*",
            head_size, "]; got ", describe(v));
    // An empty tensor's strides are arbitrary (DLPack producers give 0 or 1).
    require(v.numel() == 0 || v.stride(2) == 1, name,
            " must be contiguous in its last dimension; got ", describe(v));
    head_stride = head_size;
    elem_stride = 1;
  } else {
    require(v.size(2) == heads && v.size(3) == head_size, name, " must be [batch, seq, ", heads,
            ", ", head_size, "]; got ", describe(v));
    require(v.numel() == 0 || v.stride(3) == 1, name,
            " must be contiguous in its last dimension; got ", describe(v));
    head_stride = v.stride(2);
    elem_stride = 1;
  }
  require(b <= 1 || s == 0 || v.stride(0) == s * v.stride(1), name,
          ": batch elements must be evenly strided (stride(0) == seq * stride(1)); got ",
          describe(v));
  TensorView out = v;
  out.ndim = 3;
  out.shape = {b * s, heads, head_size, 0, 0, 0};
  out.strides = {v.stride(1), head_stride, elem_stride, 0, 0, 0};
  return out;
}

AttentionConfig make_config(const MultiHeadAttentionOptions& o) {
  AttentionConfig c;
  c.num_heads = o.num_heads;
  c.num_kv_heads = o.num_kv_heads.value_or(o.num_heads);
  c.head_size = o.head_size;
  c.scale = o.scale;
  c.dtype = o.dtype;
  c.attn_type = AttentionType::kEncoderOnly;
  return c;
}

// Skv != Sq: cross attention, whose keys come from a paged cache; the key / value rows
// [B*Skv, Hkv, D] are that cache, one token per block (block b*Skv + j = key j of element b).
AttentionConfig make_cross_config(const AttentionConfig& c) {
  AttentionConfig x = c;
  x.attn_type = AttentionType::kEncoderDecoder;
  x.block_size = 1;
  return x;
}

// [B*Skv, H, D] rows -> the [num_blocks = B*Skv, block_size = 1, H, D] cache view of them.
TensorView as_one_token_blocks(const TensorView& rows) {
  TensorView v = rows;
  v.ndim = 4;
  v.shape = {rows.size(0), 1, rows.size(1), rows.size(2), 0, 0};
  v.strides = {rows.stride(0), rows.stride(0), rows.stride(1), rows.stride(2), 0, 0};
  return v;
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionOptions& options,
                                       const Registry& registry)
    : config_(make_config(options)), device_(options.device) {
  // vLLM asserts this before anything else.
  require(config_.num_kv_heads > 0 && config_.num_heads % config_.num_kv_heads == 0, "num_heads (",
          config_.num_heads, ") must be divisible by num_kv_heads (", config_.num_kv_heads, ")");
  config_.validate();
  // A head size no backend takes may run padded (HeadPad: zero columns, the caller's scale).
  detail::PaddedSelection sel =
      detail::select_padded(registry, config_, device_, options.attn_backend);
  backend_ = sel.backend;
  run_config_ = sel.run_config;
  pad_ = std::move(sel.pad);
  cross_config_ = make_cross_config(run_config_);
  impl_ = backend_->make_impl(run_config_, device_);
}

MultiHeadAttention::~MultiHeadAttention() = default;

AttentionImpl& MultiHeadAttention::cross_impl() {
  if (!cross_impl_) {
    const std::vector<std::string> reasons = backend_->check(BackendQuery{cross_config_, device_});
    if (!reasons.empty()) {
      std::string all;
      for (const std::string& r : reasons) all += (all.empty() ? "" : "; ") + r;
      detail::fail<NotSupported>(
          "MultiHeadAttention: a key length other than the query's runs as cross attention "
          "(encoder_decoder), which backend '",
          backend_->name(), "' refuses here: ", all);
    }
    cross_impl_ = backend_->make_impl(cross_config_, device_);
  }
  return *cross_impl_;
}

const MultiHeadAttention::Step& MultiHeadAttention::step_for(int batch, int seq_q, int seq_kv) {
  auto& slot = steps_[{batch, seq_q, seq_kv}];
  if (!slot) {
    auto step = std::make_unique<Step>();
    if (seq_kv == seq_q) {
      MetadataBuilder b(config_.block_size);
      b.causal(false);
      for (int i = 0; i < batch; ++i) b.add(RequestSpec{0, seq_q, {}});
      step->host = b.build();
      validate_metadata(step->host.view(), config_.attn_type, CacheGeometry{});
    } else {
      // One request per batch element: Sq query rows against the Skv key rows of its element,
      // blocks [b*Skv, (b+1)*Skv) of the one-token-per-block view. Nothing is written.
      StepMetadata& h = step->host;
      h.causal = false;
      h.max_query_len = seq_q;
      h.max_seq_len = seq_kv;
      h.max_blocks_per_seq = seq_kv;
      h.query_start_loc.push_back(0);
      for (int i = 0; i < batch; ++i) {
        h.query_start_loc.push_back(h.query_start_loc.back() + seq_q);
        h.seq_lens.push_back(seq_kv);
        for (int j = 0; j < seq_kv; ++j) h.block_table.push_back(i * seq_kv + j);
      }
      validate_metadata(h.view(), cross_config_.attn_type,
                        CacheGeometry{int64_t(batch) * seq_kv, cross_config_.block_size});
    }
    step->device = step->host.to_device(device_);
    slot = std::move(step);
  }
  return *slot;
}

namespace {

// Writes 0 to every element of `output` [rows, heads, head_size] on `stream`: one memset when
// its rows are packed, else element by element on the host; a strided device view is refused.
void zero_rows(const TensorView& output, Stream stream) {
  if (output.is_contiguous()) {
    require_device(output.device)
        .memset_async(output.data, 0, output.nbytes(), output.device.index, stream);
    return;
  }
  require<NotSupported>(output.device.is_cpu(),
                        "MultiHeadAttention: a key length of 0 zeroes the output, which must then "
                        "be contiguous on a device; got ",
                        describe(output));
  for (int64_t r = 0; r < output.size(0); ++r) {
    for (int64_t h = 0; h < output.size(1); ++h) {
      for (int64_t e = 0; e < output.size(2); ++e) {
        store_element(output.data, output.dtype,
                      r * output.stride(0) + h * output.stride(1) + e * output.stride(2), 0.0);
      }
    }
  }
}

}  // namespace

void MultiHeadAttention::forward(const TensorView& query_in, const TensorView& key_in,
                                 const TensorView& value_in, const TensorView& output_in,
                                 Stream stream) {
  const int hq = config_.num_heads, hk = config_.num_kv_heads, d = config_.head_size;
  const TensorView query = as_rows(query_in, "query", hq, d);
  const TensorView key = as_rows(key_in, "key", hk, d);
  const TensorView value = as_rows(value_in, "value", hk, d);
  // Named here: the cross-attention path would name them kv_cache.key / kv_cache.value.
  for (const auto& [t, name] :
       {std::pair{&query_in, "query"}, {&key_in, "key"}, {&value_in, "value"}}) {
    require(t->dtype == config_.dtype, name, " must be ", dtype_name(config_.dtype),
            " (the layer's dtype); got ", describe(*t));
  }
  const TensorView output = as_rows(output_in, "output", hq, d);
  const int64_t batch = query_in.size(0), seq = query_in.size(1), seq_kv = key_in.size(1);
  require(key_in.size(0) == batch && value_in.size(0) == batch && output_in.size(0) == batch,
          "query, key, value and output must have the same batch size; got ", batch, ", ",
          key_in.size(0), ", ", value_in.size(0), ", ", output_in.size(0));
  require(output_in.size(1) == seq, "output has ", output_in.size(1),
          " tokens per batch element; the query has ", seq);
  require(value_in.size(1) == seq_kv, "key has ", seq_kv, " tokens per batch element and value ",
          value_in.size(1));
  require(batch * seq <= int64_t(1) << 31, "batch * seq (", batch * seq, ") exceeds 2^31");
  require(batch * seq_kv <= int64_t(1) << 31, "batch * key length (", batch * seq_kv,
          ") exceeds 2^31");
  if (batch == 0 || seq == 0) return;
  if (seq_kv == 0) {
    // No keys: every row sees none, and its output is 0 (FlashAttention's answer).
    zero_rows(output, stream);
    return;
  }
  const bool cross = seq_kv != seq;
  const AttentionConfig& cfg = cross ? cross_config_ : run_config_;
  AttentionImpl& impl = cross ? cross_impl() : *impl_;
  const Step& step = step_for(int(batch), int(seq), int(seq_kv));
  using detail::HeadPad;
  const bool padded = pad_ != nullptr;
  const TensorView q = padded ? pad_->pad(HeadPad::kQuery, query, stream) : query;
  const TensorView k = padded ? pad_->pad(HeadPad::kKey, key, stream) : key;
  const TensorView v = padded ? pad_->pad(HeadPad::kValue, value, stream) : value;
  const TensorView out =
      padded ? pad_->scratch(HeadPad::kOutput, output.size(0), output.size(1), stream) : output;
  ForwardArgs f;
  f.query = q;
  if (cross) {
    f.kv_cache = KVCacheView{as_one_token_blocks(k), as_one_token_blocks(v)};
  } else {
    f.key = k;
    f.value = v;
  }
  f.output = out;
  f.metadata = &step.device;
  const auto plan = backend_->plan(step.host.view(), cfg);
  if (plan->workspace_bytes() > workspace_bytes_) {
    workspace_ = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, device_);
    workspace_bytes_ = plan->workspace_bytes();
  }
  f.plan = plan.get();
  f.workspace = {workspace_.data(), plan->workspace_bytes()};
  f.stream = stream;
  check_forward_args(cfg, f, /*check_metadata=*/false);
  impl.forward(f);
  if (padded) pad_->unpad(out, output, stream);
}

Tensor MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                   const TensorView& value, Stream stream) {
  require(query.defined() && (query.ndim == 3 || query.ndim == 4), "query must be 3-D or 4-D");
  std::vector<int64_t> shape = query.shape_vector();
  Tensor out = Tensor::empty(shape, query.dtype, query.device);
  forward(query, key, value, out.view(), stream);
  return out;
}

}  // namespace pagedattn
