#include "common/thread_pool.h"

#include "common/fp_mode.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <stdexcept>
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

// KT_SERVE_IDLE_SPIN_US: how long workers poll for the next call before they sleep (default 1000; 0: at once).
int idle_spin_us_from_env() {
  const char* v = std::getenv("KT_SERVE_IDLE_SPIN_US");
  if (!v || !*v) return 1000;
  char* end = nullptr;
  const long us = std::strtol(v, &end, 10);
  if (*end != '\0' || us < 0 || us > 1000000)
    throw std::invalid_argument(std::string("KT_SERVE_IDLE_SPIN_US: expected microseconds in 0..1000000, got '") + v +
                                "'");
  return static_cast<int>(us);
}

std::atomic<int> g_idle_spin_us{-1};  // -1: the environment not read yet
}  // namespace

void set_idle_spin_us(int us) {
  if (us < 0 || us > 1000000) throw std::invalid_argument("idle spin: expected microseconds in 0..1000000");
  g_idle_spin_us.store(us);
}
int idle_spin_us() {
  int us = g_idle_spin_us.load();
  if (us < 0) {
    int unread = -1;
    g_idle_spin_us.compare_exchange_strong(unread, idle_spin_us_from_env());  // throws on a bad value
    us = g_idle_spin_us.load();
  }
  return us;
}

ThreadPool::ThreadPool(int num_threads, const std::vector<int>& cpus) {
  idle_spin_us();  // a bad KT_SERVE_IDLE_SPIN_US fails here, in the call that makes the pool, not in a worker
  for (int i = 1; i < num_threads; ++i)
    workers_.emplace_back([this, cpu = cpus.empty() ? -1 : cpus[i % cpus.size()]] {
      if (cpu >= 0) {
        // Pinned: a worker inherits its creator's CPU mask, which SGLang's CPU engine narrows to one core for the
        // OpenMP master; and the pages a worker packs are then placed on that core's NUMA node (first touch).
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        sched_setaffinity(0, sizeof(set), &set);
      }
      worker_loop();
    });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

// Claims and runs one task of the current job. When there is none left, records the job's generation in
// exhausted_gen and returns false.
bool ThreadPool::run_one(uint64_t& exhausted_gen) {
  uint64_t w = job_.load(std::memory_order_acquire);
  for (;;) {
    // fn and n are this job's if the exchange below succeeds: a new job is published only after the word
    // was closed, and the acquire loads order them after any such close.
    const Fn* fn = fn_.load(std::memory_order_acquire);
    const int64_t n = n_tasks_.load(std::memory_order_acquire);
    const uint32_t task = static_cast<uint32_t>(w);
    if (task == kClosed || task >= n) {
      exhausted_gen = w >> 32;
      return false;
    }
    if (!job_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    try {
      (*fn)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_release);
    return true;
  }
}

void ThreadPool::worker_loop() {
  const ExactDenormals fp_mode;
  uint64_t seen = 0;  // generation of the last job this worker found exhausted
  auto new_job = [&] { return (job_.load() >> 32) != seen; };
  for (;;) {
    while (run_one(seen)) {
    }
    // Poll for the next job before sleeping: within a call (see Busy) for its next phase, between calls for
    // idle_spin_us_. After the first kPausePoll the poll yields the core to any thread that wants it.
    const auto ended = std::chrono::steady_clock::now();
    const auto idle_until = ended + std::chrono::microseconds(g_idle_spin_us.load(std::memory_order_relaxed));
    const auto phase_until = std::max(idle_until, ended + kPhaseSpin);
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (new_job() || now >= (busy_.load(std::memory_order_relaxed) > 0 ? phase_until : idle_until)) break;
      if (now - ended < kPausePoll) cpu_relax();
      else std::this_thread::yield();
    }
    if (new_job()) continue;
    std::unique_lock<std::mutex> lk(mu_);
    sleeping_.fetch_add(1);  // seq_cst, paired with the caller's publish-then-check in parallel_for
    wake_cv_.wait(lk, [&] { return stop_ || new_job(); });
    sleeping_.fetch_sub(1);
    if (stop_) return;
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  if (n_tasks >= kClosed) throw std::length_error("ThreadPool::parallel_for: too many tasks");
  const ExactDenormals fp_mode;  // the caller runs tasks too
  std::lock_guard<std::mutex> job(job_mutex_);
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  const uint64_t gen = (job_.load(std::memory_order_relaxed) >> 32) + 1;
  done_.store(0, std::memory_order_relaxed);
  fn_.store(&fn, std::memory_order_release);
  n_tasks_.store(n_tasks, std::memory_order_release);
  job_.store(gen << 32);  // seq_cst: either a sleeping worker sees it, or we see that worker in sleeping_
  if (sleeping_.load() > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    wake_cv_.notify_all();
  }
  uint64_t exhausted = 0;
  while (run_one(exhausted)) {
  }
  // Every task is claimed; wait for those still running on workers.
  for (int spins = 0; done_.load(std::memory_order_acquire) != n_tasks; ++spins) {
    if (spins < 4096) cpu_relax();
    else std::this_thread::yield();
  }
  job_.store((gen << 32) | kClosed, std::memory_order_release);
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lk(mu_);
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

void set_num_threads(int n, const std::vector<int>& cpus) {
  if (n < 1) n = cpus.empty() ? default_num_threads() : static_cast<int>(cpus.size());
  std::lock_guard<std::mutex> lk(g_pool_mutex);
  if (g_pool && g_pool->num_threads() == n && cpus.empty()) return;
  g_pool = std::make_shared<ThreadPool>(n, cpus);  // calls in flight keep the old pool alive
}

}  // namespace kt
