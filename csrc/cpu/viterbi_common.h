// What the CPU Viterbi (viterbi.cpp) and k-best Viterbi (kbest.cpp) kernels share: the
// transitions padded to whole lane vectors and the in-register max over predecessors
// (column_argmax) both run per position, and viterbi_cpu, which k-best calls for k = 1.
#pragma once

#include "../tensor.h"


#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "lanes.h"
#include "log_space.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

// The transitions with each row padded to whole lane vectors (-inf in the padding, so padded
// lanes never win a max), for the in-register column argmax below.
template <typename scalar_t>
struct PaddedTransitions {
  int64_t T, stride;
  std::vector<scalar_t> rows;     // [s][t], T x stride
  std::vector<scalar_t> columns;  // [t][s], T x T: the transpose (k-best's scans over s), or empty
  PaddedTransitions(const scalar_t* trans, int64_t num_tags, bool with_columns = false)
      : T(num_tags), stride(padded_to_lanes<scalar_t>(num_tags)),
        rows(num_tags * stride, neg_inf<scalar_t>()),
        columns(with_columns ? num_tags * num_tags : 0) {
    for (int64_t s = 0; s < T; ++s) std::copy(trans + s * T, trans + (s + 1) * T, &rows[s * stride]);
    if (!with_columns) return;
    for (int64_t s = 0; s < T; ++s) {
      for (int64_t t = 0; t < T; ++t) columns[t * T + s] = trans[s * T + t];
    }
  }
};

// The max over predecessors that Viterbi and k-best both do, for all tags at once:
//     best[t] = max_s (offsets[s] + rows[s * stride + t])   (no offsets: max_s rows[s * stride + t])
//     arg[t]  = the first s that reaches it (strict comparison: the smaller predecessor wins a tie)
// for t < stride; rows are padded with -inf. Predecessors s outside, tags t inside (independent
// lanes). The kVectors running maxima and argmaxes stay in registers for the whole loop over s;
// column_argmax runs this on blocks of at most 8 vectors (for_each_register_block).
template <typename scalar_t, bool kOffsets, int kVectors>
void column_argmax_in_registers(const scalar_t* offsets, const scalar_t* rows, int64_t stride,
                                int64_t T, scalar_t* best_out,
                                typename Lanes<scalar_t>::Index* arg_out) {
  using Vector = typename Lanes<scalar_t>::Vector;
  using Mask = typename Lanes<scalar_t>::Mask;
  constexpr int64_t n = Lanes<scalar_t>::kCount;
  Vector best[kVectors];
  Mask arg[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    best[v] = load_lanes(rows + v * n);
    if constexpr (kOffsets) best[v] = offsets[0] + best[v];
    arg[v] = Mask{};
  }
  for (int64_t s = 1; s < T; ++s) {
    const scalar_t* row = rows + s * stride;
    const Mask s_lanes = Mask{} + static_cast<typename Lanes<scalar_t>::Index>(s);
    for (int v = 0; v < kVectors; ++v) {
      Vector cand = load_lanes(row + v * n);
      if constexpr (kOffsets) cand = offsets[s] + cand;
      const Mask better = cand > best[v];
      best[v] = better ? cand : best[v];
      arg[v] = better ? s_lanes : arg[v];
    }
  }
  std::memcpy(best_out, best, sizeof best);
  std::memcpy(arg_out, arg, sizeof arg);
}

// For the column reductions over predecessors (column_argmax, column_count_at_least): cuts the
// stride tags into blocks of at most 8 lane vectors and calls
// f(std::integral_constant<int, V>{}, t0) for each block [t0, t0 + V lanes), so that a block's V
// accumulators stay in registers for its whole pass over the predecessors. (A loop over memory
// for the tags beyond 8 vectors, storing and reloading its accumulators for every predecessor,
// was not vectorised for double on AVX2, where 8 vectors are 32 tags: many times slower,
// benchmarks/results/NOTES.md.) Each column's comparisons run in the same order either way, so
// the results do not depend on the blocking.
template <typename scalar_t, typename F>
void for_each_register_block(int64_t stride, F&& f) {
  constexpr int64_t n = Lanes<scalar_t>::kCount;
  int64_t t0 = 0;
  for (; t0 + 8 * n <= stride; t0 += 8 * n) f(std::integral_constant<int, 8>{}, t0);
  switch ((stride - t0) / n) {
#define CRFKIT_VECTORS_CASE(V) \
  case V:                      \
    return f(std::integral_constant<int, V>{}, t0);
    CRFKIT_VECTORS_CASE(1) CRFKIT_VECTORS_CASE(2) CRFKIT_VECTORS_CASE(3) CRFKIT_VECTORS_CASE(4)
    CRFKIT_VECTORS_CASE(5) CRFKIT_VECTORS_CASE(6) CRFKIT_VECTORS_CASE(7)
#undef CRFKIT_VECTORS_CASE
    default: return;  // stride is a whole number of vectors: nothing left
  }
}

template <typename scalar_t, bool kOffsets>
void column_argmax(const scalar_t* offsets, const scalar_t* rows, int64_t stride, int64_t T,
                   scalar_t* __restrict__ best, typename Lanes<scalar_t>::Index* __restrict__ arg) {
  for_each_register_block<scalar_t>(stride, [&](auto vectors, int64_t t0) {
    constexpr int kVectors = decltype(vectors)::value;
    column_argmax_in_registers<scalar_t, kOffsets, kVectors>(offsets, rows + t0, stride, T, best + t0,
                                                             arg + t0);
  });
}

// Number of tag sequences of length L, saturated at `cap` (k-best's list length: no sentence has
// more than T^L sequences; kbest.cpp, per_example.cpp).
inline int64_t num_sequences_capped(int64_t T, int64_t L, int64_t cap) {
  int64_t count = 1;
  for (int64_t i = 0; i < L && count < cap; ++i) count = count > cap / T ? cap : count * T;
  return std::min(count, cap);
}

// scores (B,), paths (B, L) int64: the Viterbi op's CPU kernel (viterbi.cpp).
std::tuple<Tensor, Tensor> viterbi_cpu(const Tensor& emissions_in,
                                               const Tensor& transitions_in,
                                               const Tensor& lengths_in, const Tensor& start_in,
                                               const Tensor& end_in);

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
