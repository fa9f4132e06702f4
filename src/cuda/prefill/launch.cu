// The compiled prefill instances (generated list, trimmed by PAGEDATTN_CUDA_HEAD_SIZES) and
// their selection.
#include "cuda/decode/launch.h"
#include "cuda/prefill/launch.h"

namespace pagedattn::cuda::prefill {

const std::vector<PrefillKernel>& prefill_kernels() {
  static const std::vector<PrefillKernel> table = {
#define PAGEDATTN_PREFILL_INSTANCE(act, kv, head_size)             \
  {DType::act,                                                     \
   KVKind::kv,                                                     \
   head_size,                                                      \
   80,                                                             \
   Traits<DType::act, KVKind::kv, head_size>::kBlockM,             \
   &PrefillOps<Traits<DType::act, KVKind::kv, head_size>>::launch, \
   &PrefillOps<Traits<DType::act, KVKind::kv, head_size>>::ctas_per_sm},
#define PAGEDATTN_PREFILL_SM90_INSTANCE(act, kv, head_size)                \
  {DType::act,                                                             \
   KVKind::kv,                                                             \
   head_size,                                                              \
   90,                                                                     \
   Sm90Traits<DType::act, KVKind::kv, head_size>::kBlockM,                 \
   &PrefillSm90Ops<Sm90Traits<DType::act, KVKind::kv, head_size>>::launch, \
   &PrefillSm90Ops<Sm90Traits<DType::act, KVKind::kv, head_size>>::ctas_per_sm},
#include "cuda/prefill/inst/instances.inc"
#undef PAGEDATTN_PREFILL_INSTANCE
#undef PAGEDATTN_PREFILL_SM90_INSTANCE
  };
  return table;
}

const PrefillKernel* find_prefill(DType act, DType cache, int head_size, int cc_major,
                                  bool portable) {
  const KVKind kind = decode::kv_kind_for(act, cache);
  const PrefillKernel* found = nullptr;
  for (const PrefillKernel& k : prefill_kernels()) {
    if (k.act != act || k.kv != kind || k.head_size != head_size) continue;
    if (k.sm == 90 && (portable || cc_major != 9)) continue;
    if (found == nullptr || k.sm > found->sm) found = &k;
  }
  return found;
}

}  // namespace pagedattn::cuda::prefill
