// The compiled merge_states and merge_ranks instances (generated lists) and their lookup.
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

const std::vector<MergeRanksKernel>& merge_ranks_kernels() {
  static const std::vector<MergeRanksKernel> table = {
#define PAGEDATTN_MERGE_RANKS_INSTANCE(partial, out) \
  {DType::partial, DType::out, &MergeRanksOps<DType::partial, DType::out>::launch},
#include "cuda/merge/inst/merge_ranks_instances.inc"
#undef PAGEDATTN_MERGE_RANKS_INSTANCE
  };
  return table;
}

const MergeRanksKernel* find_merge_ranks(DType partial_dtype, DType output_dtype) {
  for (const MergeRanksKernel& k : merge_ranks_kernels())
    if (k.partial_dtype == partial_dtype && k.output_dtype == output_dtype) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::merge
