// A whole decode forward in one parallel region (layer_cpu.cpp, DecoderStack). Forked once per layer group, the
// thread team sat idle through every serial stretch of a layer (norms, rotary, the glue around attention): a
// quarter of the second thread's time in the draft model. Here the team stays in one region for every layer:
//
// - The lead (the calling thread) runs the serial parts and publishes each stage of parallel work in turn: a
//   group of linear layers, or attention.
// - Every thread takes units of the published stage: the lead from the front, the others from the back, in
//   guided chunks (half of what is left, divided among the threads), until none is left.
// - While the lead works alone, the other threads read ahead: they claim units of the next stage of weights from
//   its back (up to their share of it, and half their L2 cache) and prefetch those units' weights into their L2,
//   then compute them first once the stage is published. Memory that sat idle through the serial parts now
//   brings in the next weights.
//
// A unit's outputs do not depend on which thread computes it, nor when: the same bits as any other schedule.
#pragma once
#include "aten_lite.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <immintrin.h>
#include <memory>
#include <thread>
#include <vector>

#include "kernels.h"

// A waiting thread pauses, and every 64 pauses gives its core to any other runnable thread: on a machine with more
// threads than cores (a busy neighbour, several processes) a spinning wait would hold the core the awaited thread
// needs. With nothing else to run, the yield returns at once.
struct Backoff {
  int spins = 0;
  void wait() {
    if (++spins < 64) return _mm_pause();
    spins = 0;
    std::this_thread::yield();
  }
};

// A stage's units and weights, known before its inputs exist (planned once per model).
struct StagePlan {
  int64_t units = 0, unit_bytes = 0;
  std::function<void(int64_t)> prefetch;  // unit u's weights into this thread's L2; empty: nothing to read ahead
};

struct TeamStage {
  int64_t units = 0, unit_bytes = 0;
  const std::function<void(int64_t)>* prefetch = nullptr;  // a StagePlan's; null: nothing to read ahead
  std::function<void(int64_t, int64_t)> run;  // set by the lead when it publishes the stage
  std::atomic<uint64_t> claims{0};            // unclaimed units [front, back): front in the low 32 bits
  std::atomic<int64_t> done{0};               // units computed
};

class Team {
 public:
  // `ahead_bytes`: how much a thread reads ahead per stage (about half its L2 cache)
  Team(std::vector<TeamStage>& stages, int64_t ahead_bytes)
      : stages_(stages), ahead_bytes_(ahead_bytes), threads_(at::get_num_threads()) {
    for (auto& stage : stages_) stage.claims.store(static_cast<uint64_t>(stage.units) << 32);
  }

  // Runs lead() on this thread, the rest of the team as helpers, until lead returns (its exception rethrown here
  // once every helper has stopped).
  template <typename Lead>
  void run(Lead&& lead) {
    std::exception_ptr failed;
    at::parallel_for(0, threads_, 1, [&](int64_t first, int64_t) {
      if (first != 0) return help();
      try {
        lead();
      } catch (...) {
        failed = std::current_exception();
      }
      published_.store(kStop, std::memory_order_release);
      Backoff backoff;
      while (helping_.load(std::memory_order_acquire) > 0) backoff.wait();  // none still writes into the lead's tensors
    });
    if (failed) std::rethrow_exception(failed);
  }

  // The lead: stage s (the next in order) may run as run(first, last); the lead takes its share and returns when
  // every unit is done.
  void compute(int64_t s, std::function<void(int64_t, int64_t)> run) {
    TeamStage& stage = stages_[s];
    stage.run = std::move(run);
    published_.store(s + 1, std::memory_order_release);
    take(stage, true);
    Backoff backoff;
    while (stage.done.load(std::memory_order_acquire) < stage.units) backoff.wait();
  }

 private:
  static constexpr int64_t kStop = -1;

  // Claims up to `count` units from the front or the back: -> [first, last), empty when none is left.
  static std::pair<int64_t, int64_t> claim(TeamStage& stage, bool front, int64_t count) {
    uint64_t was = stage.claims.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(was & 0xFFFFFFFFu), b = static_cast<int64_t>(was >> 32);
      if (f >= b) return {0, 0};
      const int64_t n = std::min(count, b - f);
      const uint64_t now = front ? (static_cast<uint64_t>(b) << 32) | static_cast<uint64_t>(f + n)
                                 : (static_cast<uint64_t>(b - n) << 32) | static_cast<uint64_t>(f);
      if (stage.claims.compare_exchange_weak(was, now, std::memory_order_relaxed))
        return front ? std::make_pair(f, f + n) : std::make_pair(b - n, b);
    }
  }

  void take(TeamStage& stage, bool front) {
    for (;;) {
      const uint64_t left = stage.claims.load(std::memory_order_relaxed);
      const int64_t unclaimed = static_cast<int64_t>(left >> 32) - static_cast<int64_t>(left & 0xFFFFFFFFu);
      const auto [first, last] = claim(stage, front, guided_chunk(unclaimed, threads_));
      if (first == last) return;
      stage.run(first, last);
      stage.done.fetch_add(last - first, std::memory_order_release);
    }
  }

  // A helper: stages in order as they are published, reading ahead while it waits.
  void help() {
    helping_.fetch_add(1, std::memory_order_acq_rel);
    int64_t next = 0, ahead_stage = -1, ahead_bytes = 0;
    std::vector<int64_t> mine;  // units of ahead_stage claimed and prefetched, descending
    const int64_t count = static_cast<int64_t>(stages_.size());
    Backoff backoff;
    for (;;) {
      const int64_t published = published_.load(std::memory_order_acquire);
      if (published == kStop) break;
      if (next < published) {
        TeamStage& stage = stages_[next];
        if (ahead_stage == next && !mine.empty()) {
          std::sort(mine.begin(), mine.end());
          for (size_t i = 0; i < mine.size();) {  // contiguous runs as one call
            size_t j = i + 1;
            while (j < mine.size() && mine[j] == mine[j - 1] + 1) ++j;
            stage.run(mine[i], mine[j - 1] + 1);
            i = j;
          }
          stage.done.fetch_add(static_cast<int64_t>(mine.size()), std::memory_order_release);
          mine.clear();
        }
        take(stage, false);
        ++next;
        continue;
      }
      // Waiting for the lead: read ahead in the first stage from `next` on that has weights.
      int64_t target = next;
      while (target < count && stages_[target].prefetch == nullptr) ++target;
      if (target != ahead_stage) ahead_stage = target, ahead_bytes = 0;
      // at most this thread's share of the stage: a helper that claimed all of it would compute it alone (at one
      // row, from its L2 quickly; at several, compute-bound while the lead waits)
      if (target < count && ahead_bytes + stages_[target].unit_bytes <= ahead_bytes_ &&
          static_cast<int64_t>(mine.size()) < stages_[target].units / threads_) {
        const auto [first, last] = claim(stages_[target], false, 1);
        if (first < last) {
          (*stages_[target].prefetch)(first);
          mine.push_back(first);
          ahead_bytes += stages_[target].unit_bytes;
          continue;
        }
      }
      backoff.wait();
    }
    helping_.fetch_sub(1, std::memory_order_acq_rel);
  }

  std::vector<TeamStage>& stages_;
  const int64_t ahead_bytes_, threads_;
  std::atomic<int64_t> published_{0};  // stages [0, published) may run; kStop: the forward is over
  std::atomic<int64_t> helping_{0};
};
