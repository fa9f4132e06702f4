// A timeline of the MLA decode kernel's events, for finding what sets the pace of a tile (a
// diagnostic build only: compiled out unless PAGEDATTN_MLA_TRACE is defined).
//
// -DPAGEDATTN_MLA_TRACE=N records, in launch N (counted per traced thread) of an instance,
// clock64() at numbered events of tiles 0 .. kTraceTiles - 1 for thread 0 of every warpgroup of
// CTAs 0, 1 and gridDim.x / 2 (x only; split 0), then printf's one line per tile and role:
//   MLAT <cta> <role> <tile> <t0> .. <t11>
// role 0 is the producer (only with -DPAGEDATTN_MLA_TRACE_PRODUCER, which moves registers to
// it), 1 + c consumer warpgroup c; unrecorded events print 0. clock64 is
// one counter per SM, so the roles of a CTA share a time base. bench/gpu/mla_trace.py reads the
// lines. A stamp right after a named barrier may be hoisted above it by ptxas (seen: a
// "barrier passed" stamp before the other side arrived); stamps after mbarrier try_wait loops
// cannot be. The records sit in local memory (the traced thread's stores only), so the timeline is
// that of a slightly perturbed kernel: compare it with the untraced time first.
#pragma once

#include <cstdint>
#include <cstdio>

namespace pagedattn::cuda::mla {

#ifdef PAGEDATTN_MLA_TRACE
inline constexpr int kTraceTiles = 48;
inline constexpr int kTraceEvents = 12;

static __device__ unsigned g_trace_launches[3 * 3];

struct Trace {
  unsigned long long t[kTraceEvents][kTraceTiles];
  int cta = -1, role = 0;

  __device__ void begin(int role_) {
    role = role_;
#ifndef PAGEDATTN_MLA_TRACE_PRODUCER
    if (role == 0) return;  // the producer's 24 registers leave no room for the records
#endif
    const int x = int(blockIdx.x), mid = int(gridDim.x) / 2;
    const int slot = x == 0 ? 0 : x == 1 ? 1 : x == mid ? 2 : -1;
    if (slot < 0 || blockIdx.y != 0 || threadIdx.x % 128 != 0) return;
    if (atomicAdd(&g_trace_launches[slot * 3 + role], 1u) + 1 != PAGEDATTN_MLA_TRACE) return;
    cta = x;
    for (int e = 0; e < kTraceEvents; ++e) {
      for (int j = 0; j < kTraceTiles; ++j) t[e][j] = 0;
    }
  }
  __device__ __forceinline__ void at(int e, int j) {
    if (cta >= 0 && j >= 0 && j < kTraceTiles) t[e][j] = clock64();
  }
  __device__ void print() const {
    if (cta < 0) return;
    for (int j = 0; j < kTraceTiles; ++j) {
      printf("MLAT %d %d %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", cta,
             role, j, t[0][j], t[1][j], t[2][j], t[3][j], t[4][j], t[5][j], t[6][j], t[7][j],
             t[8][j], t[9][j], t[10][j], t[11][j]);
    }
  }
};
#define PAGEDATTN_MLA_TRACE_BEGIN(tr, role) \
  Trace tr;                                 \
  tr.begin(role)
#define PAGEDATTN_MLA_TRACE_AT(tr, e, j) tr.at(e, j)
#define PAGEDATTN_MLA_TRACE_PRINT(tr) tr.print()
#else
#define PAGEDATTN_MLA_TRACE_BEGIN(tr, role) static_cast<void>(0)
#define PAGEDATTN_MLA_TRACE_AT(tr, e, j) static_cast<void>(0)
#define PAGEDATTN_MLA_TRACE_PRINT(tr) static_cast<void>(0)
#endif

}  // namespace pagedattn::cuda::mla
