// One process per rank on this host without MPI: the launcher of the NCCL test and benchmark
// (tests/nccl, bench/gpu/bench_dcp.cpp). The parent never touches CUDA or NCCL (a CUDA context
// does not survive fork): it forks the ranks, rank 0 makes the communicator's id (an opaque
// blob, ncclUniqueId) and sends it to the others through pipes, and the parent waits, killing
// the ranks it started when one fails (the others would wait in a collective forever) or when
// the time limit passes.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace pagedattn::test {

/// The id blob's size (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kRankIdBytes = 128;

namespace detail_fork {

inline bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
  }
  return true;
}

inline bool read_all(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}

}  // namespace detail_fork

/// Runs `rank_main(rank, world, id)` in `world` forked processes and returns 0 when every rank
/// exited 0, else the first non-zero status seen (128 + signal for a killed rank, 124 on the
/// time limit). Rank 0 calls `make_id()` (kRankIdBytes) first; a rank's exception is printed
/// and exits it with 3. After a rank fails, the others get `grace_s` seconds, then SIGKILL.
inline int fork_ranks(
    int world, int timeout_s, int grace_s, const std::function<std::string()>& make_id,
    const std::function<int(int rank, int world, const std::string& id)>& rank_main) {
  std::vector<int> pipes(size_t(2 * world), -1);  // [2r] read end, [2r + 1] write end; r >= 1
  for (int r = 1; r < world; ++r) {
    if (::pipe(&pipes[size_t(2 * r)]) != 0) {
      std::perror("fork_ranks: pipe");
      return 2;
    }
  }
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork_ranks: fork");
      for (pid_t p : pids) ::kill(p, SIGKILL);
      return 2;
    }
    if (pid == 0) {
      // The rank: keep only its own ends (a reader must see EOF when rank 0 dies).
      std::setvbuf(stdout, nullptr, _IOLBF, 0);
      for (int q = 1; q < world; ++q) {
        if (q != r) ::close(pipes[size_t(2 * q)]);
        if (r != 0) ::close(pipes[size_t(2 * q + 1)]);
      }
      int status = 3;
      try {
        std::string id;
        if (r == 0) {
          id = make_id();
          id.resize(kRankIdBytes);
          for (int q = 1; q < world; ++q) {
            detail_fork::write_all(pipes[size_t(2 * q + 1)], id.data(), id.size());
            ::close(pipes[size_t(2 * q + 1)]);
          }
        } else {
          id.resize(kRankIdBytes);
          if (!detail_fork::read_all(pipes[size_t(2 * r)], id.data(), id.size())) {
            std::fprintf(stderr, "[rank %d/%d] no id from rank 0 (it failed first)\n", r, world);
            std::fflush(nullptr);
            ::_exit(3);
          }
        }
        status = rank_main(r, world, id);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d/%d] error: %s\n", r, world, e.what());
      }
      std::fflush(nullptr);
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  for (int fd : pipes) {
    if (fd >= 0) ::close(fd);
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto kill_at = start + std::chrono::seconds(timeout_s);
  int result = 0;
  size_t running = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (running > 0) {
    bool reaped = false;
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) != pids[r]) continue;
      done[r] = true;
      --running;
      reaped = true;
      const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (code != 0) {
        std::fprintf(stderr, "fork_ranks: rank %zu of %d exited with %d\n", r, world, code);
        if (result == 0) {
          result = code;
          kill_at = std::min(kill_at, clock::now() + std::chrono::seconds(grace_s));
        }
      }
    }
    if (running > 0 && clock::now() >= kill_at) {
      std::fprintf(stderr, "fork_ranks: killing %zu rank(s) still running after %s\n", running,
                   result == 0 ? "the time limit" : "a rank failed");
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) ::kill(pids[r], SIGKILL);
      }
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) ::waitpid(pids[r], nullptr, 0);
      }
      return result != 0 ? result : 124;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return result;
}

/// The number of CUDA devices, asked in a forked child so that this process keeps no CUDA
/// context (-1 when the child failed). `count` is the child's query, e.g. cudaGetDeviceCount.
inline int count_devices_in_child(const std::function<int()>& count) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const int n = count();
    detail_fork::write_all(fds[1], reinterpret_cast<const char*>(&n), sizeof n);
    ::_exit(0);
  }
  ::close(fds[1]);
  int n = -1;
  if (pid < 0 || !detail_fork::read_all(fds[0], reinterpret_cast<char*>(&n), sizeof n)) n = -1;
  ::close(fds[0]);
  if (pid > 0) ::waitpid(pid, nullptr, 0);
  return n;
}

}  // namespace pagedattn::test
