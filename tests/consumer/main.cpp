// Uses the installed library as an engine would: a layer, a cache, one decode step.
#include <cmath>
#include <cstdio>
#include <vector>

#include "pagedattn/pagedattn.h"

int main() {
  using namespace pagedattn;
  ForwardContext ctx;
  AttentionOptions o;
  o.num_heads = 4;
  o.num_kv_heads = 1;
  o.head_size = 16;
  o.scale = 0.25f;
  o.prefix = "model.layers.0.attn";
  o.dtype = DType::kF32;
  Attention layer(ctx, o);
  KVCache cache = KVCache::allocate(layer.config(), 4);
  layer.bind_kv_cache({cache.view()});
  StepMetadata step = MetadataBuilder(16).add({0, 3, {2}}).build();
  AttentionMetadata md = step.view();
  std::vector<float> q(3 * 64, 0.5f), k(3 * 16, 0.25f), v(3 * 16);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 16);
  ctx.begin_step({&md});
  Tensor out = layer.forward(TensorView::contiguous(q.data(), DType::kF32, {3, 64}),
                             TensorView::contiguous(k.data(), DType::kF32, {3, 16}),
                             TensorView::contiguous(v.data(), DType::kF32, {3, 16}));
  ctx.end_step();
  // Equal keys: each output is the mean of the visible values, i.e. v itself (all rows equal).
  const float got = out.data_as<float>()[2 * 64 + 5];
  std::printf("%s -> output[2][5] = %g\n", layer.extra_repr().c_str(), got);
  return std::fabs(got - 5.0f) < 1e-5f ? 0 : 1;
}
