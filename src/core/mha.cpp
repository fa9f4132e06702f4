#include "pagedattn/mha.h"

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
    require(v.stride(2) == 1, name, " must be contiguous in its last dimension; got ", describe(v));
    head_stride = head_size;
    elem_stride = 1;
  } else {
    require(v.size(2) == heads && v.size(3) == head_size, name, " must be [batch, seq, ", heads,
            ", ", head_size, "]; got ", describe(v));
    head_stride = v.stride(2);
    elem_stride = v.stride(3);
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

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionOptions& options,
                                       const Registry& registry)
    : config_(make_config(options)), device_(options.device) {
  // vLLM asserts this before anything else.
  require(config_.num_kv_heads > 0 && config_.num_heads % config_.num_kv_heads == 0, "num_heads (",
          config_.num_heads, ") must be divisible by num_kv_heads (", config_.num_kv_heads, ")");
  config_.validate();
  backend_ = &registry.select(BackendQuery{config_, device_}, options.attn_backend);
  impl_ = backend_->make_impl(config_, device_);
}

MultiHeadAttention::~MultiHeadAttention() = default;

const MultiHeadAttention::Step& MultiHeadAttention::step_for(int batch, int seq) {
  auto& slot = steps_[{batch, seq}];
  if (!slot) {
    auto step = std::make_unique<Step>();
    MetadataBuilder b(config_.block_size);
    b.causal(false);
    for (int i = 0; i < batch; ++i) b.add(RequestSpec{0, seq, {}});
    step->host = b.build();
    step->device = step->host.to_device(device_);
    validate_metadata(step->host.view(), config_.attn_type, CacheGeometry{});
    slot = std::move(step);
  }
  return *slot;
}

void MultiHeadAttention::forward(const TensorView& query_in, const TensorView& key_in,
                                 const TensorView& value_in, const TensorView& output_in,
                                 Stream stream) {
  const int hq = config_.num_heads, hk = config_.num_kv_heads, d = config_.head_size;
  const TensorView query = as_rows(query_in, "query", hq, d);
  const TensorView key = as_rows(key_in, "key", hk, d);
  const TensorView value = as_rows(value_in, "value", hk, d);
  const TensorView output = as_rows(output_in, "output", hq, d);
  const int64_t batch = query_in.size(0), seq = query_in.size(1);
  require(key_in.size(0) == batch && value_in.size(0) == batch && output_in.size(0) == batch,
          "query, key, value and output must have the same batch size; got ", batch, ", ",
          key_in.size(0), ", ", value_in.size(0), ", ", output_in.size(0));
  require(output_in.size(1) == seq, "output has ", output_in.size(1),
          " tokens per batch element; the query has ", seq);
  require(value_in.size(1) == key_in.size(1), "key has ", key_in.size(1),
          " tokens per batch element and value ", value_in.size(1));
  require<NotSupported>(key_in.size(1) == seq,
                        "MultiHeadAttention: a key length other than the query's (Sq=", seq,
                        ", Skv=", key_in.size(1), ") is not supported yet");
  require(batch * seq <= int64_t(1) << 31, "batch * seq (", batch * seq, ") exceeds 2^31");
  if (batch == 0 || seq == 0) return;
  const Step& step = step_for(int(batch), int(seq));
  ForwardArgs f;
  f.query = query;
  f.key = key;
  f.value = value;
  f.output = output;
  f.metadata = &step.device;
  const auto plan = backend_->plan(step.host.view(), config_);
  if (plan->workspace_bytes() > workspace_bytes_) {
    workspace_ = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, device_);
    workspace_bytes_ = plan->workspace_bytes();
  }
  f.plan = plan.get();
  f.workspace = {workspace_.data(), plan->workspace_bytes()};
  f.stream = stream;
  check_forward_args(config_, f, /*check_metadata=*/false);
  impl_->forward(f);
}

Tensor MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                   const TensorView& value) {
  require(query.defined() && (query.ndim == 3 || query.ndim == 4), "query must be 3-D or 4-D");
  std::vector<int64_t> shape = query.shape_vector();
  Tensor out = Tensor::empty(shape, query.dtype, query.device);
  forward(query, key, value, out.view());
  return out;
}

}  // namespace pagedattn
