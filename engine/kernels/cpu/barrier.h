// A barrier for the threads of one OpenMP parallel region that spins briefly before it sleeps.
//
// The server runs OpenMP with OMP_WAIT_POLICY=PASSIVE (app/__main__.py): between parallel regions torch's
// threads sleep, so they never take a core from the engine thread, the event loop or another process. But
// libgomp's passive barrier sleeps at once too, and a decode step of the one-call decoder passes six
// barriers a layer: each one a futex wake whose sleeper needs a core to be scheduled on again, tens of
// microseconds on a virtual machine, milliseconds a step (docs/performance.md, "Barriers that spin").
// Inside the region the threads share one step's work, so a wait there is short unless a thread lost its
// core: this barrier spins for up to `spin_ns` and then sleeps on a futex as libgomp's does. And where the
// waits run long (other work holds the cores, so a thread is often off its core mid-step), spinning only
// burns what the late thread needs: the barrier keeps a process-wide score of how recent waits went and
// stops spinning while more than about one in nine would have outlasted the spin.

#pragma once

#include "intrinsics.h"
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

namespace sluice {

inline int64_t monotonic_ns() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

// +1 for a wait a spin would have covered, -8 for one it would not, within [-64, 64]; spin while >= 0.
// Updated without ordering by every waiter: a lost update now and then only nudges a heuristic.
inline std::atomic<int>& spin_score() {
  static std::atomic<int> score{0};
  return score;
}

class SpinBarrier {
 public:
  // Set by one thread of the region, before any thread waits (the region's team size).
  int threads = 1;

  void wait(int64_t spin_ns) {
    if (threads == 1) return;
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    const int64_t arrived = monotonic_ns();
    // acq_rel: the last to arrive sees every thread's writes before the barrier, and publishes them
    // with the new generation.
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);
      released_.store(arrived, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_seq_cst);
      // seq_cst against the sleeper's increment below: either it sees the new generation or this sees it.
      if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    std::atomic<int>& score = spin_score();
    if (spin_ns > 0 && score.load(std::memory_order_relaxed) >= 0 && spin(generation, arrived + spin_ns)) {
      score.store(std::min(score.load(std::memory_order_relaxed) + 1, 64), std::memory_order_relaxed);
      return;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == generation) futex(FUTEX_WAIT_PRIVATE, generation);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    // How long a spin would have had to last: the last thread's arrival, not this one's wake-up.
    const bool covered = released_.load(std::memory_order_relaxed) - arrived <= spin_ns;
    const int now = score.load(std::memory_order_relaxed);
    score.store(covered ? std::min(now + 1, 64) : std::max(now - 8, -64), std::memory_order_relaxed);
  }

 private:
  // Whether the generation moved on before `deadline`.
  bool spin(uint32_t generation, int64_t deadline) {
    for (uint32_t i = 1;; ++i) {
      if (generation_.load(std::memory_order_acquire) != generation) return true;
      _mm_pause();
      if (i % 64 == 0 && monotonic_ns() > deadline) return false;
    }
  }

  long futex(int op, uint32_t value) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), op, value, nullptr, nullptr, 0);
  }

  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
  std::atomic<int64_t> released_{0};  // when the last thread arrived, for the waiters' score
  std::atomic<int> sleepers_{0};
};

}  // namespace sluice
