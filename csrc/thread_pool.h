// A small fork-join pool: the calling thread works too, idle workers sleep (no busy-waiting between calls).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kt {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(task) for task in [0, n_tasks), tasks handed out dynamically (an atomic counter), so uneven tasks
  // balance. Returns when all are done. Calls from different threads are serialised (one job at a time).
  void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void run_tasks();

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;  // one job at a time
  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};  // workers still inside the current job
  uint64_t generation_ = 0;
  std::atomic<uint64_t> generation_seen_{0};
  bool stop_ = false;
  std::exception_ptr error_;
};

// The process-wide pool; resized by set_num_threads (default: physical cores available to this process).
std::shared_ptr<ThreadPool> global_pool();
void set_num_threads(int n);
int default_num_threads();

}  // namespace kt
