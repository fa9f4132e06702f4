// The compiled merge_states instances (generated list) and their lookup.
#include "cuda/merge/launch.h"

namespace pagedattn::cuda::merge {

const std::vector<MergeKernel>& merge_kernels() {
  static const std::vector<MergeKernel> table = {
#define PAGEDATTN_MERGE_INSTANCE(dtype) {DType::dtype, &MergeOps<DType::dtype>::launch},
#include "cuda/merge/inst/instances.inc"
#undef PAGEDATTN_MERGE_INSTANCE
  };
  return table;
}

const MergeKernel* find_merge(DType dtype) {
  for (const MergeKernel& k : merge_kernels())
    if (k.dtype == dtype) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::merge
