// Work items shared out over XLA:CPU's intra-op thread pool (included by the CPU kernels in this folder).
//
// Items [0, num_items) are claimed through an atomic counter by the calling thread and by up to
// `max_threads - 1` tasks scheduled on the pool; the call returns once every item is done. A task that
// starts late finds nothing left, so the caller never waits on a task that has not started: two kernels
// running on the pool at once cannot wait on each other.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_rollout {

struct NoThreadScope {};

template <class Scope, class Body>
struct PoolItems {
  PoolItems(Body b, int64_t n) : body(std::move(b)), num_items(n) {}
  Body body;
  int64_t num_items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void drain() {
    std::optional<Scope> scope;  // set up on a thread only once it has claimed an item
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      if (!scope) scope.emplace();
      body(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs body(i) for every item i on the caller and the pool. `Scope` is constructed on each thread before
// its first item and destroyed after its last (per-thread setup such as AMX tile configuration). `body`
// is copied into state the pool's tasks share: it may outlive this call, and is then never called.
template <class Scope = NoThreadScope, class Body>
void run_items(xla::ffi::ThreadPool& pool, int64_t num_items, int64_t max_threads, Body body) {
  auto work = std::make_shared<PoolItems<Scope, Body>>(std::move(body), num_items);
  for (int64_t t = 1; t < std::min(max_threads, num_items); ++t) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < num_items) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace jax_rollout
