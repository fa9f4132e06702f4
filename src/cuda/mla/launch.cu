// The compiled MLA instances (generated list) and their selection. check() and forward() both
// go through find_mla(), so what is compiled and what is selectable cannot drift apart.
#include "cuda/mla/launch.h"

namespace pagedattn::cuda::mla {

const std::vector<MlaKernel>& mla_kernels() {
  static const std::vector<MlaKernel> table = {
#define PAGEDATTN_MLA_INSTANCE(act, kv, c)                       \
  {DType::act, KVKind::kv, Consumer::c,                          \
   &MlaOps<Traits<DType::act, KVKind::kv, Consumer::c>>::launch, \
   &MlaOps<Traits<DType::act, KVKind::kv, Consumer::c>>::ctas_per_sm},
#define PAGEDATTN_MLA_COMBINE_INSTANCE(act)
#include "cuda/mla/inst/instances.inc"
#undef PAGEDATTN_MLA_INSTANCE
#undef PAGEDATTN_MLA_COMBINE_INSTANCE
  };
  return table;
}

const std::vector<MlaCombineKernel>& mla_combine_kernels() {
  static const std::vector<MlaCombineKernel> table = {
#define PAGEDATTN_MLA_INSTANCE(act, kv, c)
#define PAGEDATTN_MLA_COMBINE_INSTANCE(act) {DType::act, &MlaCombineOps<DType::act>::launch},
#include "cuda/mla/inst/instances.inc"
#undef PAGEDATTN_MLA_INSTANCE
#undef PAGEDATTN_MLA_COMBINE_INSTANCE
  };
  return table;
}

const char* consumer_name(Consumer c) {
  switch (c) {
    case Consumer::kRedundant:
      return "redundant";
    case Consumer::kSplitS:
      return "split-s";
    case Consumer::kSeesaw:
      return "seesaw";
    case Consumer::kAuto:
      break;
  }
  return "auto";
}

Consumer default_consumer(KVKind) {
  return Consumer::kSplitS;
}

const MlaKernel* find_mla(DType act, DType cache, Consumer consumer) {
  const bool act16 = act == DType::kF16 || act == DType::kBF16;
  if (!act16) return nullptr;
  KVKind kind;
  if (cache == act) {
    kind = KVKind::kSame;
  } else if (cache == DType::kFp8E4M3) {
    kind = KVKind::kFp8;
  } else {
    return nullptr;
  }
  if (consumer == Consumer::kAuto) consumer = default_consumer(kind);
  for (const MlaKernel& k : mla_kernels())
    if (k.act == act && k.kv == kind && k.consumer == consumer) return &k;
  return nullptr;
}

const MlaCombineKernel* find_mla_combine(DType act) {
  for (const MlaCombineKernel& k : mla_combine_kernels())
    if (k.act == act) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::mla
