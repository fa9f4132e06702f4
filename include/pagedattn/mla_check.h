// check_mla_step: the oracle check of one MLAAttention step (the MLA counterpart of
// case_file.h's check_case), for tests, tools and `pagedattn run`'s verification.
#pragma once

#include "pagedattn/case_file.h"
#include "pagedattn/metadata.h"
#include "pagedattn/mla.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// One step of an MLAAttention layer as it ran, for check_mla_step. Host tensors and views.
struct MLAStepCase {
  MLAOptions options;          ///< the layer's (attn_backend, device and calibration are ignored)
  TensorView kv_b_proj;        ///< [L, N * (P + V)], as given to load_kv_b_proj
  float k_scale = 1.0f;        ///< the latent scale the step ran with (fp8 caches)
  TensorView latent_cache;     ///< before the step: [num_blocks, block_size, L + R], cache dtype
  AttentionMetadata metadata;  ///< the step (KV-cache group 0), host views
  TensorView q;                ///< [T, N, P + R]
  TensorView kv_c_normed;      ///< [T, L]
  TensorView k_pe;             ///< [T, R]
};

/// Checks an MLA step's `output` [T, N * V] and `latent_cache_after` (host) against the same
/// layer with its attention on the float64 reference backend, output in float64 (the oracle),
/// within the budget of the low-precision reference (accuracy.h, default_tolerance(dtype)); the
/// latent cache must be bit-identical to the reference's write. All three run the step's
/// formulation (step.options.formulation) and the layer's own arithmetic (absorption,
/// expansion, up-projection), so this checks what the backend computes, its merge_states
/// included; tests/unit/test_mla.cpp checks the layer against the non-absorbed formulation.
CaseCheck check_mla_step(const MLAStepCase& step, const TensorView& output,
                         const TensorView& latent_cache_after);

}  // namespace pagedattn
