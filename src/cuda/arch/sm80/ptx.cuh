// Ampere-era instructions that Hopper runs too (cp.async, ldmatrix, mma.sync m16n8k16, L2
// cache policies, prmt, packed 16-bit multiplies), each wrapped once, and the two sm_90
// programmatic-dependent-launch controls. With arch/sm90/ (wgmma, setmaxnreg, TMA) this is the
// only place in the tree with inline PTX.
#pragma once

#include <cstdint>

namespace pagedattn::cuda::sm80 {

/// Shared-memory address of a generic pointer into shared memory (the operand cp.async and
/// ldmatrix take).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// An L2 policy that evicts these lines first: decode streams each KV byte once, so it should
/// not push Q, block tables or split partials out of L2.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

/// 16-byte global -> shared copy that bypasses L1. `src_bytes` < 16 zero-fills the rest (0 =
/// write zeros and read nothing; `src` must still be a valid address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes,
                                            uint64_t policy) {
  // The L2 cache-hint form of this copy raises "illegal instruction" in some launches (driver
  // 580, sm_90: docs/kernels/decode.md), so the policy is taken and ignored, ready for a retry.
  (void)policy;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

/// 4-byte global -> shared copy through L1 (the .cg form takes only 16 bytes); `src_bytes` 0
/// writes zeros.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/// Waits until at most `kPending` of this thread's committed groups are still in flight.
/// Other threads' copies become visible only after a barrier (__syncwarp / __syncthreads).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// Four 8x8 b16 matrices; lane l gives the row address of matrix l/8, row l%8. Register i
/// receives matrix i, this lane holding (row lane/4, columns 2*(lane%4) + {0,1}).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

/// As ldmatrix_x4, transposed: this lane holds (rows 2*(lane%4) + {0,1}, column lane/4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

/// d += a * b for one m16n8k16 tile, float accumulators, 16-bit operands (bf16 when kBF16,
/// else fp16). a: A rows {g, g+8} x k {2t, 2t+1, 2t+8, 2t+9}; b: k {2t, 2t+1} / {2t+8, 2t+9} x
/// column g; d: rows {g, g+8} x columns {2t, 2t+1} (g = lane/4, t = lane%4).
template <bool kBF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// 2^x in one MUFU.EX2: exp2f without fast-math adds a range fix-up (a compare, a multiply
/// and a select around the MUFU) that ncu showed as a third of the prefill softmax's FP32
/// work. The fix-up only matters for results below 2^-126, which flush to zero here: no
/// probability or correction factor of the softmax needs them (relative error ~2^-22).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// Byte permute: result byte i = byte (sel >> 4i) & 7 of {a (bytes 0-3), b (bytes 4-7)}.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

/// Two 16-bit products a * b (round to nearest, subnormal inputs and results kept: no .ftz),
/// bf16x2 when kBF16, else f16x2.
template <bool kBF16>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (kBF16) {
#if __CUDA_ARCH__ >= 900
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#else
    // mul.bf16x2 is sm_90's; a fused multiply-add of -0 rounds the same product once (and
    // keeps a zero product's sign, as the multiply does).
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

/// Programmatic dependent launch (sm_90): blocks until the grids this one depends on have
/// completed and their memory is visible; a no-op for a grid launched without the attribute.
/// Compiled out below sm_90, where grids of a stream never overlap (the host launches without
/// the attribute there: launch_with_pdl).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/// Lets the next grid of the stream (launched with the programmatic-serialization attribute)
/// be scheduled before this one ends; its griddepcontrol.wait still waits for our completion.
__device__ __forceinline__ void launch_dependent_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace pagedattn::cuda::sm80
