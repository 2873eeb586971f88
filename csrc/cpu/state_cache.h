// Memory for the saved forward state of log_partition_saving, recycled between calls.
//
// Why: the state (16 * slots * L * stride bytes, e.g. 1 MiB at (32, 128, 9) and 21 MiB at
// (256, 128, 37)) is allocated by every differentiable log Z and freed after its backward. glibc
// serves blocks of this size with fresh mappings (or trims them back to the kernel), so the next
// call page-faults on every page it writes; a training loop repeats this every step. Recycling
// the last few freed buffers turns that into a warm reuse.
//
// A freed buffer is kept when the cache stays within kMaxCachedBytes and kMaxCachedBuffers,
// otherwise returned to the system. A request takes the smallest kept buffer that holds it and
// is at most twice its size plus the 64 KiB the sizes are rounded to (so a small state does not
// pin a large buffer). The memory is not
// initialised. release_cached_state() frees everything kept (crfkit.release_cached_memory()).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace crfkit {
namespace cpu {

inline constexpr int64_t kMaxCachedBytes = int64_t{256} << 20;
inline constexpr int64_t kMaxCachedBuffers = 4;

// An uninitialised CPU double tensor of these sizes (contiguous), in recycled memory.
at::Tensor recycled_double_tensor(at::IntArrayRef sizes);

// Frees every kept buffer; returns the bytes freed.
int64_t release_cached_state();

// Bytes currently kept (for tests).
int64_t cached_state_bytes();

}  // namespace cpu
}  // namespace crfkit
