// A small fork-join pool: the calling thread works too. After a job, workers poll for the next one for a while
// (set_idle_spin_us) before they sleep.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
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
  // cpus: where worker i runs (cpus[i % size]; the caller, thread 0, is not moved), or empty: not pinned.
  explicit ThreadPool(int num_threads, const std::vector<int>& cpus = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(task) for task in [0, n_tasks), tasks handed out dynamically, so uneven tasks balance. Returns when
  // all are done. Calls from different threads are serialised (one job at a time).
  void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn);

  // Held across the phases of one kernel call: while one is alive, workers wait for the next job spinning
  // (phases follow each other within microseconds), however short the idle spin is.
  class Busy {
   public:
    explicit Busy(ThreadPool& pool) : pool_(pool) { pool_.busy_.fetch_add(1); }
    ~Busy() { pool_.busy_.fetch_sub(1); }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    ThreadPool& pool_;
  };

 private:
  using Fn = std::function<void(int64_t)>;
  static constexpr uint32_t kClosed = 0xffffffffu;
  // Between calls: a decode step calls us a dozen times or more, 0.1-0.5 ms of Python apart, and waking a
  // sleeping worker (a futex wake; on a VM the halted vCPU too) added 35-40 µs to each decode-sized call
  // (measured on a 2-core Zen 3 VM). After kPausePoll the poll calls sched_yield, so a thread that wants the
  // core (torch's OpenMP team between our calls) runs first.
  static constexpr std::chrono::microseconds kPausePoll{50};
  static constexpr std::chrono::milliseconds kPhaseSpin{1};  // the most a phase waits spinning, the caller stalled

  void worker_loop();
  bool run_one(uint64_t& exhausted_gen);

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;  // one job at a time
  // The job: (generation << 32) | next task, claimed by compare-exchange. The caller waits only for claimed
  // tasks, never for a worker to wake up: one that wakes late finds the tasks gone (a VM's idle vCPU can take
  // a few hundred µs to wake, longer than a whole decode-sized phase). Closed (kClosed) between jobs, so a
  // worker that read the old word can never claim a task of the next job.
  std::atomic<uint64_t> job_{kClosed};
  std::atomic<const Fn*> fn_{nullptr};
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int> busy_{0};
  std::mutex mu_;  // guards the sleep/wake hand-over, stop_ and error_
  std::condition_variable wake_cv_;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The process-wide pool; resized by set_num_threads (default: physical cores available to this process), its
// workers pinned to `cpus` when given (n < 1: one thread per listed CPU).
std::shared_ptr<ThreadPool> global_pool();
void set_num_threads(int n, const std::vector<int>& cpus = {});
// How long workers poll for the next job after one ends, in µs (0: they sleep at once), for every pool of the
// process; the default is KT_SERVE_IDLE_SPIN_US, else 1000.
void set_idle_spin_us(int us);
int idle_spin_us();
int default_num_threads();

// Runs rows(r0, r1) over [0, n) rows: on the calling thread when the call touches fewer than 2^15 values (handing
// off costs more than it saves), else on the pool in up to 4 tasks a thread. The small ops of a decode step
// (norms, rotary, GDN steps) share it.
template <class Fn>
void parallel_rows(int64_t n, int64_t values, Fn&& rows) {
  constexpr int64_t kSerialValues = 1 << 15;
  if (n <= 1 || values < kSerialValues) {
    if (n > 0) rows(int64_t{0}, n);
    return;
  }
  auto pool = global_pool();
  const int64_t tasks = std::min<int64_t>(n, 4 * pool->num_threads());
  pool->parallel_for(tasks, [&](int64_t i) { rows(i * n / tasks, (i + 1) * n / tasks); });
}

}  // namespace kt
