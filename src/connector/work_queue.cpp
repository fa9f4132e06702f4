#include "connector/work_queue.h"

#include <pthread.h>
#include <signal.h>

namespace pagedattn::connector {

WorkQueue::WorkQueue(int num_threads) {
  // The threads write to sockets: a peer that went away must give EPIPE, not kill the process.
  // Blocking SIGPIPE in these threads (they inherit the mask) keeps the process's disposition.
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this, i] { run(i); });
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkQueue::post(std::function<void(int)> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void WorkQueue::run(int index) {
  for (;;) {
    std::function<void(int)> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job(index);
  }
}

}  // namespace pagedattn::connector
