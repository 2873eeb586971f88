// CPU memory recycled between calls, for the large per-call tensors of a differentiable log Z:
// the marginals and expected transition counts its forward keeps for the backward, and the
// emissions' gradient the backward returns.
//
// Why: these blocks (4 B L T bytes each in float32, e.g. 4.8 MiB at (256, 128, 37)) are
// allocated and freed on every training step. glibc serves blocks of this size with fresh
// mappings (or trims them back to the kernel), so each step page-faults on every page it writes,
// a measurable share of a forward+backward (benchmarks/results/NOTES.md). Recycling the last few
// freed buffers turns that into a warm reuse.
//
// A freed buffer is kept when the cache stays within kMaxCachedBytes and kMaxCachedBuffers,
// otherwise returned to the system. A request takes the smallest kept buffer that holds it and
// is at most twice its size plus the 64 KiB the sizes are rounded to (so a small tensor does not
// pin a large buffer). Requests under 64 KiB are ordinary allocations (malloc reuses those
// without faults). The memory is not initialised. release_recycled_memory() frees everything
// kept (crfkit.release_cached_memory()).
#pragma once

#include "../tensor.h"


#include <cstdint>

namespace crfkit {
namespace cpu {

inline constexpr int64_t kMaxCachedBytes = int64_t{256} << 20;
inline constexpr int64_t kMaxCachedBuffers = 8;

// An uninitialised contiguous CPU tensor of these sizes and dtype, in recycled memory when it
// is 64 KiB or more.
Tensor recycled_tensor(Sizes sizes, ScalarType dtype);

// Frees every kept buffer; returns the bytes freed.
int64_t release_recycled_memory();

// Bytes currently kept (for tests).
int64_t recycled_memory_bytes();

}  // namespace cpu
}  // namespace crfkit
