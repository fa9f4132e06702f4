// The compiled prefill instances (generated list, trimmed by PAGEDATTN_CUDA_HEAD_SIZES).
#include "cuda/decode/launch.h"
#include "cuda/prefill/launch.h"

namespace pagedattn::cuda::prefill {

const std::vector<PrefillKernel>& prefill_kernels() {
  static const std::vector<PrefillKernel> table = {
#define PAGEDATTN_PREFILL_INSTANCE(act, kv, head_size)             \
  {DType::act,                                                     \
   KVKind::kv,                                                     \
   head_size,                                                      \
   Traits<DType::act, KVKind::kv, head_size>::kBlockM,             \
   &PrefillOps<Traits<DType::act, KVKind::kv, head_size>>::launch, \
   &PrefillOps<Traits<DType::act, KVKind::kv, head_size>>::ctas_per_sm},
#include "cuda/prefill/inst/instances.inc"
#undef PAGEDATTN_PREFILL_INSTANCE
  };
  return table;
}

const PrefillKernel* find_prefill(DType act, DType cache, int head_size) {
  const KVKind kind = decode::kv_kind_for(act, cache);
  for (const PrefillKernel& k : prefill_kernels())
    if (k.act == act && k.kv == kind && k.head_size == head_size) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::prefill
