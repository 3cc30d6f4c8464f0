#include "thread_pool.h"

#include <sched.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <utility>

namespace kt {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_tasks() {
  for (;;) {
    int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    if (t >= n_tasks_) return;
    try {
      (*fn_)(t);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_tasks_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    // Phases of one kernel call follow each other within microseconds: spin briefly on the generation
    // counter before sleeping, so a multi-phase call does not pay a futex wake-up per phase.
    auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (generation_seen_.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() < spin_until)
      cpu_relax();
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks();
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  std::lock_guard<std::mutex> job(job_mutex_);
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_tasks_ = n_tasks;
    next_.store(0, std::memory_order_relaxed);
    active_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    error_ = nullptr;
    ++generation_;
    generation_seen_.store(generation_, std::memory_order_release);
  }
  wake_cv_.notify_all();
  run_tasks();
  // The caller finished its share; wait (briefly spinning, then sleeping) for the workers to finish theirs.
  auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  while (active_.load(std::memory_order_acquire) != 0 && std::chrono::steady_clock::now() < spin_until)
    cpu_relax();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return active_.load(std::memory_order_acquire) == 0; });
    fn_ = nullptr;
    err = std::exchange(error_, nullptr);
  }
  if (err) std::rethrow_exception(err);
}

int default_num_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    unsigned n = std::thread::hardware_concurrency();
    return n ? static_cast<int>(n) : 1;
  }
  // Count physical cores: distinct (package, core) pairs among the CPUs we may run on (SMT siblings share one).
  std::set<std::pair<std::string, std::string>> cores;
  int logical = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    ++logical;
    std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream pkg(base + "physical_package_id"), core(base + "core_id");
    std::string p, c;
    if (!(pkg >> p) || !(core >> c)) return logical > 0 ? CPU_COUNT(&set) : 1;
    cores.emplace(p, c);
  }
  return cores.empty() ? 1 : static_cast<int>(cores.size());
}

namespace {
std::mutex g_pool_mutex;
std::shared_ptr<ThreadPool> g_pool;
}  // namespace

std::shared_ptr<ThreadPool> global_pool() {
  std::lock_guard<std::mutex> lk(g_pool_mutex);
  if (!g_pool) g_pool = std::make_shared<ThreadPool>(default_num_threads());
  return g_pool;
}

void set_num_threads(int n) {
  if (n < 1) n = default_num_threads();
  std::lock_guard<std::mutex> lk(g_pool_mutex);
  if (g_pool && g_pool->num_threads() == n) return;
  g_pool = std::make_shared<ThreadPool>(n);  // calls in flight keep the old pool alive
}

}  // namespace kt
