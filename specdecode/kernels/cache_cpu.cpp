// A tree step's KV cache compaction in one native call: the accepted nodes' slots move down behind the agreed
// prefix. torch's way (an index tensor, then two copies per slot over every layer and head) cost ~90 us a step on
// the caches the verify forward had just flushed; these are plain row copies.
#include "aten_lite.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

// k, v [layers, batch, heads, slots, head_dim], contiguous on the CPU: slot from[i] moves to slot to[i] in every
// (layer, batch, head) plane. Moves run in order, so a slot moved away may be overwritten by a later move (a
// compaction: to[i] < from[i], both ascending).
void move_slots(const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& to, const std::vector<int64_t>& from) {
  TORCH_CHECK(to.size() == from.size(), "move_slots: as many destinations as sources");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->is_cpu() && t->is_contiguous() && t->dim() == 5,
                "move_slots: a contiguous CPU cache [layers, batch, heads, slots, head_dim]");
    TORCH_CHECK(t->sizes() == k.sizes() && t->scalar_type() == k.scalar_type(), "move_slots: k and v differ");
  }
  const int64_t slots = k.size(3);
  for (size_t i = 0; i < to.size(); ++i)
    TORCH_CHECK(to[i] >= 0 && to[i] < slots && from[i] >= 0 && from[i] < slots, "move_slots: slot out of range");
  const int64_t planes = k.size(0) * k.size(1) * k.size(2);
  const int64_t row = k.size(4) * static_cast<int64_t>(k.element_size()), plane = slots * row;
  for (const at::Tensor* t : {&k, &v}) {
    char* base = static_cast<char*>(t->data_ptr());
    for (int64_t p = 0; p < planes; ++p)
      for (size_t i = 0; i < to.size(); ++i)
        if (to[i] != from[i]) std::memmove(base + p * plane + to[i] * row, base + p * plane + from[i] * row, row);
  }
}
