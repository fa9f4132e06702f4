// The compiled MLA instances (generated list) and their selection. check() and forward() both
// go through find_mla(), so what is compiled and what is selectable cannot drift apart.
#include "cuda/mla/launch.h"

namespace pagedattn::cuda::mla {

const std::vector<MlaKernel>& mla_kernels() {
  static const std::vector<MlaKernel> table = {
#if PAGEDATTN_CUDA_HOPPER
#define PAGEDATTN_MLA_INSTANCE(act, kv, c, cols)                       \
  {DType::act,                                                         \
   KVKind::kv,                                                         \
   Consumer::c,                                                        \
   cols,                                                               \
   Traits<DType::act, KVKind::kv, Consumer::c, cols>::kBlockM,         \
   Traits<DType::act, KVKind::kv, Consumer::c, cols>::kClusterMerge,   \
   &MlaOps<Traits<DType::act, KVKind::kv, Consumer::c, cols>>::launch, \
   &MlaOps<Traits<DType::act, KVKind::kv, Consumer::c, cols>>::ctas_per_sm},
#else  // wgmma kernels: compiled only with 90a in PAGEDATTN_CUDA_ARCHS
#define PAGEDATTN_MLA_INSTANCE(act, kv, c, cols)
#endif
#define PAGEDATTN_MLA_COMBINE_INSTANCE(act)
#include "cuda/mla/inst/instances.inc"
#undef PAGEDATTN_MLA_INSTANCE
#undef PAGEDATTN_MLA_COMBINE_INSTANCE
  };
  return table;
}

const std::vector<MlaCombineKernel>& mla_combine_kernels() {
  static const std::vector<MlaCombineKernel> table = {
#define PAGEDATTN_MLA_INSTANCE(act, kv, c, cols)
#define PAGEDATTN_MLA_COMBINE_INSTANCE(act) {DType::act, &MlaCombineOps<DType::act>::launch},
#include "cuda/mla/inst/instances.inc"
#undef PAGEDATTN_MLA_INSTANCE
#undef PAGEDATTN_MLA_COMBINE_INSTANCE
  };
  return table;
}

const char* consumer_name(Consumer c) {
  switch (c) {
    case Consumer::kSplitS:
      return "split-s";
    case Consumer::kSeesaw:
      return "seesaw";
    case Consumer::kSwapAB:
      return "swap-ab";
    case Consumer::kSwapAB32:
      return "swap-ab-32";
    case Consumer::kAuto:
      break;
  }
  return "auto";
}

// The seesaw (per-half stage release) against split-S: 128 heads x 1 token 1.04-1.10x (two M
// tiles per request, L2 serves the second CTA's reads: latency-bound); 16 heads 0.93-0.96x
// (DRAM-bound: one M tile). Current figures: docs/kernels/mla.md.
// Swap AB is not a default here: it serves steps, not configurations (the backend takes it
// under auto when a step's requests have at most its 16 or 32 rows: impl.cpp, cuda_backend.cpp's
// plan).
Consumer default_consumer(KVKind kv, int num_heads) {
  return kv == KVKind::kSame && num_heads > kBlockM ? Consumer::kSeesaw : Consumer::kSplitS;
}

const MlaKernel* find_mla(DType act, DType cache, int num_heads, Consumer consumer, int out_cols) {
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
  if (consumer == Consumer::kAuto) consumer = default_consumer(kind, num_heads);
  const MlaKernel* best = nullptr;  // the narrowest that holds out_cols
  for (const MlaKernel& k : mla_kernels()) {
    if (k.act == act && k.kv == kind && k.consumer == consumer && k.max_out_cols >= out_cols &&
        (best == nullptr || k.max_out_cols < best->max_out_cols)) {
      best = &k;
    }
  }
  return best;
}

const MlaKernel* mla_for_step(const MlaKernel* configured, const MlaKernel* wide,
                              const NarrowMla& narrow, int64_t max_query_len, int num_heads,
                              int out_cols) {
  for (const MlaKernel* k : narrow) {
    if (k != nullptr && out_cols <= k->max_out_cols && max_query_len * num_heads <= k->block_m) {
      return k;
    }
  }
  if (configured != nullptr && out_cols <= configured->max_out_cols) return configured;
  return wide != nullptr && out_cols <= wide->max_out_cols ? wide : nullptr;
}

const MlaCombineKernel* find_mla_combine(DType act) {
  for (const MlaCombineKernel& k : mla_combine_kernels())
    if (k.act == act) return &k;
  return nullptr;
}

}  // namespace pagedattn::cuda::mla
