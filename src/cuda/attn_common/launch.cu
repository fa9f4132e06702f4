// The compiled split combines (generated list) and their selection, and the cache kinds.
#include "cuda/attn_common/launch.h"

namespace pagedattn::cuda::attn {

const std::vector<CombineKernel>& combine_kernels() {
  static const std::vector<CombineKernel> table = {
#define PAGEDATTN_COMBINE_INSTANCE(act) {DType::act, &CombineOps<DType::act>::launch},
#include "cuda/attn_common/inst/instances.inc"
#undef PAGEDATTN_COMBINE_INSTANCE
  };
  return table;
}

KVKind kv_kind_for(DType act, DType cache) {
  const bool act16 = act == DType::kF16 || act == DType::kBF16;
  if (act16 && cache == act) return KVKind::kSame;
  if (act16 && is_fp8(cache)) return KVKind::kFp8;
  return KVKind::kAny;
}

const CombineKernel* find_combine(DType act) {
  for (const CombineKernel& k : combine_kernels())
    if (k.act == act) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::attn
