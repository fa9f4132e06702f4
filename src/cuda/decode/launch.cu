// The compiled decode instances (generated list, trimmed by PAGEDATTN_CUDA_HEAD_SIZES) and
// their selection. check() and forward() both go through find_decode(), so what is compiled
// and what is selectable cannot drift apart.
#include <algorithm>

#include "cuda/attn_common/launch.h"
#include "cuda/decode/launch.h"

namespace pagedattn::cuda::decode {

const std::vector<DecodeKernel>& decode_kernels() {
  static const std::vector<DecodeKernel> table = {
#define PAGEDATTN_DECODE_INSTANCE(act, kv, head_size)             \
  {DType::act, KVKind::kv, head_size,                             \
   &DecodeOps<Traits<DType::act, KVKind::kv, head_size>>::launch, \
   &DecodeOps<Traits<DType::act, KVKind::kv, head_size>>::ctas_per_sm},
#include "cuda/decode/inst/instances.inc"
#undef PAGEDATTN_DECODE_INSTANCE
  };
  return table;
}

const DecodeKernel* find_decode(DType act, DType cache, int head_size) {
  const KVKind kind = attn::kv_kind_for(act, cache);
  if (!attn::serves_head_size(head_size, int64_t(dtype_size(cache)))) return nullptr;
  // The tensor-core instance of the smallest compiled head size that holds the problem's (its
  // bucket: the columns past the problem's are zeros in smem), else the generic kernel.
  const DecodeKernel *bucket = nullptr, *generic = nullptr;
  for (const DecodeKernel& k : decode_kernels()) {
    if (k.act != act || k.kv != kind) continue;
    if (k.head_size == 0) {
      generic = &k;
    } else if (k.head_size >= head_size && (bucket == nullptr || k.head_size < bucket->head_size)) {
      bucket = &k;
    }
  }
  return bucket != nullptr ? bucket : generic;
}

std::vector<int> compiled_head_sizes(DType act, KVKind kv) {
  std::vector<int> sizes;
  for (const DecodeKernel& k : decode_kernels())
    if (k.act == act && k.kv == kv && k.head_size > 0) sizes.push_back(k.head_size);
  std::sort(sizes.begin(), sizes.end());
  return sizes;
}

}  // namespace pagedattn::cuda::decode
