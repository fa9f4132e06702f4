// The cpu backend's threads: one process-wide pool whose idle workers spin briefly and then
// sleep, so that a step shares a busy machine instead of spinning through other processes'
// time slices (OpenMP's default barriers spin for milliseconds: a run with four busy processes
// beside it on two cores took 8x its idle time).
#pragma once

#include <cstdint>
#include <functional>

namespace pagedattn::cpu {

/// How a parallel loop runs: on `threads` threads (the caller and threads - 1 pool workers),
/// each waiting thread spinning up to `spin_us` microseconds for the next job or the loop's
/// end before it sleeps on a futex (0: sleep at once).
struct Parallelism {
  int threads = 1;
  int spin_us = 50;
};

/// The thread count by default: OpenMP's (OMP_NUM_THREADS, else the CPUs this process may use).
int default_threads();

/// Runs fn(i) for every i in [0, n), items taken one at a time from a shared counter. Returns
/// when all are done; the first exception an item throws is rethrown here (the rest of the
/// items still run). A call made from inside another one's items, or while another thread's
/// call holds the pool, runs its items on the calling thread alone.
void parallel_for(int64_t n, const Parallelism& how, const std::function<void(int64_t)>& fn);

}  // namespace pagedattn::cpu
