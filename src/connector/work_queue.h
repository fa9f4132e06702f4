// A fixed set of threads running posted jobs in order of posting (one at a time per thread).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pagedattn::connector {

class WorkQueue {
 public:
  /// Starts `num_threads` threads.
  explicit WorkQueue(int num_threads);
  /// Runs the jobs already posted, then joins the threads.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  int num_threads() const { return int(threads_.size()); }
  /// Queues `job`; it gets the index of the thread that runs it, in [0, num_threads()). Jobs
  /// must not throw (an escaping exception ends the process, as from any thread).
  void post(std::function<void(int)> job);

 private:
  void run(int index);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(int)>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace pagedattn::connector
