// The compiled write_kv instances (generated list, trimmed by CMake) and their lookup.
#include "cuda/cache_ops/launch.h"

namespace pagedattn::cuda::cache_ops {

const std::vector<WriteKVKernel>& write_kv_kernels() {
  static const std::vector<WriteKVKernel> table = {
#define PAGEDATTN_WRITE_KV_INSTANCE(act, cache) \
  {DType::act, DType::cache, &WriteKVOps<DType::act, DType::cache>::launch},
#include "cuda/cache_ops/inst/instances.inc"
#undef PAGEDATTN_WRITE_KV_INSTANCE
  };
  return table;
}

const WriteKVKernel* find_write_kv(DType act, DType cache) {
  for (const WriteKVKernel& k : write_kv_kernels())
    if (k.act == act && k.cache == cache) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::cache_ops
