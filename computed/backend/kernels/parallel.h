// Work items over XLA's intra-op threads, for the kernels of this directory.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace loraplane {

// Runs work->run(i) for every i in [0, total) on the calling thread and the pool's threads, and
// returns when all are done. Threads claim items until none is left; the caller works too, then
// waits only for items another thread has already claimed, so it never waits on a thread the pool
// has not started. Helpers hold the work and the progress by shared_ptr: one that starts after
// every item is claimed finds nothing to do and touches no buffer.
template <typename Work>
void run_parallel(xla::ffi::ThreadPool& pool, std::shared_ptr<const Work> work, int64_t total) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto drain = [](const std::shared_ptr<const Work>& w, const std::shared_ptr<Progress>& p, int64_t total) {
    for (int64_t i; (i = p->next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      w->run(i);
      p->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work, progress, total, drain]() { drain(work, progress, total); });
  drain(work, progress, total);
  while (progress->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace loraplane
