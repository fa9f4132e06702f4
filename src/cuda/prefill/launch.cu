// The compiled prefill instances (generated list, trimmed by PAGEDATTN_CUDA_HEAD_SIZES) and
// their selection.
#include "cuda/attn_common/launch.h"
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
   false,                                                          \
   0,                                                              \
   &PrefillOps<Traits<DType::act, KVKind::kv, head_size>>::launch, \
   &PrefillOps<Traits<DType::act, KVKind::kv, head_size>>::ctas_per_sm},
#if PAGEDATTN_CUDA_HOPPER
#define PAGEDATTN_PREFILL_SM90_INSTANCE(act, kv, head_size)                \
  {DType::act,                                                             \
   KVKind::kv,                                                             \
   head_size,                                                              \
   90,                                                                     \
   Sm90Traits<DType::act, KVKind::kv, head_size>::kBlockM,                 \
   false,                                                                  \
   KVKind::kv == KVKind::kSame && head_size % 64 == 0                      \
       ? Sm90Traits<DType::act, KVKind::kv, head_size>::kBlockN            \
       : 0,                                                                \
   &PrefillSm90Ops<Sm90Traits<DType::act, KVKind::kv, head_size>>::launch, \
   &PrefillSm90Ops<Sm90Traits<DType::act, KVKind::kv, head_size>>::ctas_per_sm},
#define PAGEDATTN_PREFILL_SM90_FP8_INSTANCE(act, head_size)                        \
  {DType::act,                                                                     \
   KVKind::kFp8,                                                                   \
   head_size,                                                                      \
   90,                                                                             \
   Sm90Traits<DType::act, KVKind::kFp8, head_size, true>::kBlockM,                 \
   true,                                                                           \
   0,                                                                              \
   &PrefillSm90Ops<Sm90Traits<DType::act, KVKind::kFp8, head_size, true>>::launch, \
   &PrefillSm90Ops<Sm90Traits<DType::act, KVKind::kFp8, head_size, true>>::ctas_per_sm},
#else  // the Hopper instances are not compiled (PAGEDATTN_CUDA_ARCHS without 90a)
#define PAGEDATTN_PREFILL_SM90_INSTANCE(act, kv, head_size)
#define PAGEDATTN_PREFILL_SM90_FP8_INSTANCE(act, head_size)
#endif
#include "cuda/prefill/inst/instances.inc"
#undef PAGEDATTN_PREFILL_INSTANCE
#undef PAGEDATTN_PREFILL_SM90_INSTANCE
#undef PAGEDATTN_PREFILL_SM90_FP8_INSTANCE
  };
  return table;
}

const PrefillKernel* find_prefill(DType act, DType cache, int head_size, int cc_major,
                                  bool portable, bool fp8_math) {
  const KVKind kind = attn::kv_kind_for(act, cache);
  const bool want_fp8 = fp8_math && cache == DType::kFp8E4M3;
  if (!attn::serves_head_size(head_size, int64_t(dtype_size(cache)))) return nullptr;
  // The smallest compiled head size that holds the problem's (the bucket; the kernels keep the
  // columns past the problem's at zero), then the best kernel of that size.
  const PrefillKernel* found = nullptr;
  auto rank = [&](const PrefillKernel& k) { return k.sm + (k.fp8_math ? 1 : 0); };
  for (const PrefillKernel& k : prefill_kernels()) {
    if (k.act != act || k.kv != kind || k.head_size < head_size) continue;
    if (k.sm == 90 && (portable || cc_major != 9)) continue;
    if (k.fp8_math && !want_fp8) continue;
    if (found == nullptr || k.head_size < found->head_size ||
        (k.head_size == found->head_size && rank(k) > rank(*found))) {
      found = &k;
    }
  }
  return found;
}

}  // namespace pagedattn::cuda::prefill
