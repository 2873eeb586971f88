// Fixed-width SIMD vectors for the CPU kernels, as GCC / Clang vector extensions: 64 bytes, one
// AVX-512 register where the CPU has it, two AVX2 (or four SSE / NEON) ones otherwise, so the
// code needs no intrinsics and still builds for any -march. Per-tag arrays that the kernels
// walk a vector at a time are padded to a whole number of vectors (padded_to_lanes), so the
// loops have no scalar tail.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace crfkit {
namespace cpu {

template <typename scalar_t>
struct Lanes {
  static constexpr int kBytes = 64;
  static constexpr int64_t kCount = kBytes / sizeof(scalar_t);  // 16 floats or 8 doubles
  typedef scalar_t Vector __attribute__((vector_size(kBytes)));
  using Index = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
  typedef Index Mask __attribute__((vector_size(kBytes)));  // comparison results, lane indices
};

// n rounded up to a whole number of vectors of scalar_t
template <typename scalar_t>
inline int64_t padded_to_lanes(int64_t n) {
  constexpr int64_t k = Lanes<scalar_t>::kCount;
  return (n + k - 1) / k * k;
}

// The sentences b with lengths[b] >= min_length, longest first; equal lengths keep batch order
// (stable). Both batch-lane kernels group consecutive sentences of this order, so a group
// wastes few positions.
inline std::vector<int64_t> longest_first(const int64_t* lengths, int64_t B, int64_t min_length) {
  std::vector<int64_t> order;
  for (int64_t b = 0; b < B; ++b) {
    if (lengths[b] >= min_length) order.push_back(b);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return lengths[x] > lengths[y]; });
  return order;
}

// Runs body(work, g) for every group g in [0, num_groups) on the threads of at::parallel_for,
// each thread with its own work space make_work(). A work queue: each thread takes the next
// group until none is left. The batch-lane kernels order their groups longest first, so the
// threads end close together whatever the spread of lengths (fixed chunks would give one thread
// all the longest sentences).
template <typename MakeWork, typename Body>
void for_each_group(int64_t num_groups, MakeWork&& make_work, Body&& body) {
  if (num_groups <= 0) return;
  std::atomic<int64_t> next_group{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_groups);
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    auto work = make_work();
    for (int64_t g = next_group++; g < num_groups; g = next_group++) body(work, g);
  });
}

template <typename scalar_t>
inline typename Lanes<scalar_t>::Vector load_lanes(const scalar_t* p) {
  typename Lanes<scalar_t>::Vector v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename scalar_t>
inline void store_lanes(scalar_t* p, typename Lanes<scalar_t>::Vector v) {
  std::memcpy(p, &v, sizeof v);
}

}  // namespace cpu
}  // namespace crfkit
