// Weights in 2 MB pages. A forward streams every weight once; with 4 KB pages the 1.5B target's ~1 GB takes
// ~250,000 page-table walks a forward. Linux backs a region with 2 MB pages (transparent huge pages) when it asks
// before its first write (the system's default "madvise" mode). Memory reused from the allocator was already written
// in 4 KB pages (a load frees the row layout just before the repacked copy is made), so a weight gets a fresh
// mapping of its own, aligned to 2 MB. The bits stored are the same either way: only where they sit changes.
// Measured on an AMX Xeon VM (BENCHMARKS.md, "The draft model in 4-bit blocks, weights in 2 MB pages"): 28 Q4_K
// layers of the target's FFN shape 10% faster at one row, 48 Q4_0 layers of the draft's 19%; whole forwards and the
// benchmark less (the helper thread's read-ahead already hides much of the page walks): 1-2% end to end.
#pragma once
#include "aten_lite.h"
#include <ATen/ops/from_blob.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdint>

#include "kernels.h"

// On unless set_huge_pages turns it off (SPECDECODE_HUGE_PAGES=0 through settings.py) (weights loaded after it: an A/B in one process).
inline std::atomic<bool> huge_pages_wanted{true};

// An uninitialised tensor, in 2 MB pages where the system grants them (at::empty below 2 MB, or if mmap fails).
inline at::Tensor empty_in_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20, kPage = 4096;
  int64_t numel = 1;
  for (const int64_t size : sizes) numel *= size;
  const uintptr_t bytes = static_cast<uintptr_t>(numel) * options.dtype().itemsize();
#ifdef MADV_HUGEPAGE
  if (bytes >= kHuge && huge_pages_wanted.load(std::memory_order_relaxed)) {
    const uintptr_t length = (bytes + kPage - 1) & ~(kPage - 1);
    void* raw = mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      const auto base = reinterpret_cast<uintptr_t>(raw), start = (base + kHuge - 1) & ~(kHuge - 1);
      // the mapping's head before the 2 MB boundary, and its tail after the tensor (base + kHuge > start always)
      if (start > base) munmap(raw, start - base);
      munmap(reinterpret_cast<void*>(start + length), base + kHuge - start);
      madvise(reinterpret_cast<void*>(start), length, MADV_HUGEPAGE);  // advice: 4 KB pages where it is not taken
      return at::from_blob(reinterpret_cast<void*>(start), sizes, [length](void* p) { munmap(p, length); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}
