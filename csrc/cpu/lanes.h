// Fixed-width SIMD vectors for the CPU kernels, as GCC / Clang vector extensions, one register
// of the widest kind the build targets: 64 bytes with AVX-512, 32 with AVX / AVX2, 16 otherwise
// (SSE, NEON), so the code needs no intrinsics and still builds for any -march. Never wider than
// a register: without AVX-512, GCC expands the comparisons and selects on 64-byte vectors
// piecewise, many times slower (benchmarks/results/NOTES.md). Per-tag arrays that the kernels
// walk a vector at a time are padded to a whole number of vectors (padded_to_lanes), so the
// loops have no scalar tail.
#pragma once

#include "../tensor.h"


#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

template <typename scalar_t>
struct Lanes {
#if defined(__AVX512F__)
  static constexpr int kBytes = 64;
#elif defined(__AVX__)
  static constexpr int kBytes = 32;
#else
  static constexpr int kBytes = 16;
#endif
  static constexpr int64_t kCount = kBytes / sizeof(scalar_t);  // AVX-512: 16 floats or 8 doubles
  typedef scalar_t Vector __attribute__((vector_size(kBytes)));
  using Index = std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t>;
  typedef Index Mask __attribute__((vector_size(kBytes)));  // comparison results, lane indices
};

// Whether any lane of a comparison result (a Mask or LaneMask: 0 or all ones per lane) is set.
template <typename Mask>
inline bool any_lane(Mask m) {
  constexpr int kLaneCount = sizeof(Mask) / sizeof(m[0]);
  std::remove_cvref_t<decltype(m[0])> r = 0;
  for (int j = 0; j < kLaneCount; ++j) r |= m[j];
  return r != 0;
}

// n rounded up to a whole number of vectors of scalar_t
template <typename scalar_t>
inline int64_t padded_to_lanes(int64_t n) {
  constexpr int64_t k = Lanes<scalar_t>::kCount;
  return (n + k - 1) / k * k;
}

// A variable that forces a choice between a batch-lane kernel and its per-sentence twin
// (CRFKIT_LOG_PARTITION_LANES, CRFKIT_VITERBI_LANES): 1 when it starts with '1', 0 when set to
// anything else, -1 when unset or empty (the kernel's own rule decides).
inline int forced_by_environment(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return -1;
  return value[0] == '1' ? 1 : 0;
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

// Runs body(work, g) for every group g in [0, num_groups) on the threads of parallel_for,
// each thread with its own work space make_work(). A work queue: each thread takes the next
// group until none is left. The batch-lane kernels order their groups longest first, so the
// threads end close together whatever the spread of lengths (fixed chunks would give one thread
// all the longest sentences).
template <typename MakeWork, typename Body>
void for_each_group(int64_t num_groups, MakeWork&& make_work, Body&& body) {
  if (num_groups <= 0) return;
  std::atomic<int64_t> next_group{0};
  const int64_t num_workers = std::min<int64_t>(num_threads(), num_groups);
  parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
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

// K scalar_t values at p (unaligned) as a vector of lane_t: a plain load where the types match,
// else a load of K scalar_t and a lane-wise conversion (float to double: vcvtps2pd).
template <typename lane_t, int64_t K, typename scalar_t>
inline typename Lanes<lane_t>::Vector load_converted(const scalar_t* p) {
  if constexpr (std::is_same_v<lane_t, scalar_t>) {
    return load_lanes(p);
  } else {
    typedef scalar_t Source __attribute__((vector_size(K * sizeof(scalar_t))));
    Source v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, typename Lanes<lane_t>::Vector);
  }
}

// ---- emissions to lane layout ------------------------------------------------------------------
// A group's emissions, sentence j's (n_j, T) block read as a flat row source_j[k] (k = i * T + t),
// form a kCount x (n * T) matrix; the lane layout is its transpose, emit[k][j] = source_j[k].
// It is done kCount x kCount blocks at a time in registers: kCount vector loads, log2(kCount)
// rounds of kCount two-vector shuffles, kCount vector stores (instead of kCount^2 scalar moves).

// One round of the transpose for the rows a (row index bit kBit clear) and b (bit set): swaps
// bit kBit of the row index with bit kBit of the column index,
//     a'[c] = c has the bit ? b[c - bit] : a[c],   b'[c] = c has the bit ? b[c] : a[c + bit]
template <int kBit, typename Vector, typename Mask, size_t... c>
inline void exchange_index_bit(Vector& a, Vector& b, std::index_sequence<c...>) {
  constexpr int64_t K = sizeof...(c);
  constexpr int64_t bit = int64_t{1} << kBit;
  // Shuffle indices: 0 .. K-1 pick from a, K .. 2K-1 from b.
#if defined(__clang__)
  const Vector a_new = __builtin_shufflevector(a, b, ((c & bit) ? K + (c ^ bit) : c)...);
  const Vector b_new = __builtin_shufflevector(a, b, ((c & bit) ? K + c : (c | bit))...);
#else
  const Vector a_new = __builtin_shuffle(a, b, Mask{((c & bit) ? K + (c ^ bit) : c)...});
  const Vector b_new = __builtin_shuffle(a, b, Mask{((c & bit) ? K + c : (c | bit))...});
#endif
  a = a_new;
  b = b_new;
}

// rows[r][c] -> rows[c][r] for a kCount x kCount block held in kCount vectors.
template <typename scalar_t, int kBit = 0>
inline void transpose_lanes(typename Lanes<scalar_t>::Vector* rows) {
  constexpr int64_t K = Lanes<scalar_t>::kCount;
  if constexpr ((int64_t{1} << kBit) < K) {
    constexpr int64_t bit = int64_t{1} << kBit;
    for (int64_t r = 0; r < K; ++r) {
      if (r & bit) continue;
      exchange_index_bit<kBit, typename Lanes<scalar_t>::Vector, typename Lanes<scalar_t>::Mask>(
          rows[r], rows[r | bit], std::make_index_sequence<K>{});
    }
    transpose_lanes<scalar_t, kBit + 1>(rows);
  }
}

// emit[k][j] = source[j][k] for k < limit[j], 0 for limit[j] <= k < padded_to_lanes(max limit)
// (lanes with limit 0, idle ones, are all 0), converted from scalar_t to lane_t (float to double
// for the probability-space lanes). Only the first limit[j] scalars of source[j] are read.
// Returns the lanes whose emissions hold NaN or +inf (the check of has_nan_or_posinf, done on the
// transposed vectors).
template <typename lane_t, typename scalar_t>
inline typename Lanes<lane_t>::Mask emissions_to_lanes(const scalar_t* const* source,
                                                       const int64_t* limit,
                                                       typename Lanes<lane_t>::Vector* emit) {
  using Vector = typename Lanes<lane_t>::Vector;
  using Mask = typename Lanes<lane_t>::Mask;
  constexpr int64_t K = Lanes<lane_t>::kCount;
  constexpr lane_t kInf = std::numeric_limits<lane_t>::infinity();
  Mask bad = Mask{};
  const int64_t longest = *std::max_element(limit, limit + K);
  for (int64_t k0 = 0; k0 < longest; k0 += K) {
    Vector rows[K];  // rows[j] = source[j][k0 .. k0 + K), zero past limit[j]
    for (int64_t j = 0; j < K; ++j) {
      if (k0 + K <= limit[j]) {
        rows[j] = load_converted<lane_t, K>(source[j] + k0);
      } else {
        scalar_t tail[K] = {};
        if (k0 < limit[j]) std::copy(source[j] + k0, source[j] + limit[j], tail);
        rows[j] = load_converted<lane_t, K>(tail);
      }
    }
    transpose_lanes<lane_t>(rows);
    for (int64_t m = 0; m < K; ++m) {
      bad |= (rows[m] != rows[m]) | (rows[m] == kInf);
      emit[k0 + m] = rows[m];
    }
  }
  return bad;
}

// The inverse of emissions_to_lanes, for outputs: dest[j][k] = lanes[k][j] for k < limit[j],
// converted from lane_t to scalar_t (double to float for the probability-space lanes). Only
// the first limit[j] scalars of dest[j] are written; lanes[k] is read for k < padded_to_lanes
// of the largest limit, so the buffer must hold that many vectors.
template <typename lane_t, typename scalar_t>
inline void lanes_to_rows(const typename Lanes<lane_t>::Vector* lanes, const int64_t* limit,
                          scalar_t* const* dest) {
  using Vector = typename Lanes<lane_t>::Vector;
  constexpr int64_t K = Lanes<lane_t>::kCount;
  typedef scalar_t Row __attribute__((vector_size(K * sizeof(scalar_t))));
  const int64_t longest = *std::max_element(limit, limit + K);
  for (int64_t k0 = 0; k0 < longest; k0 += K) {
    Vector rows[K];
    for (int64_t m = 0; m < K; ++m) rows[m] = lanes[k0 + m];
    transpose_lanes<lane_t>(rows);  // rows[j] = lane j's scalars k0 .. k0 + K
    for (int64_t j = 0; j < K; ++j) {
      if (k0 >= limit[j]) continue;
      const Row row = __builtin_convertvector(rows[j], Row);
      if (k0 + K <= limit[j]) {
        std::memcpy(dest[j] + k0, &row, sizeof row);
      } else {
        for (int64_t m = 0; k0 + m < limit[j]; ++m) dest[j][k0 + m] = row[m];
      }
    }
  }
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
