// The k-best merge of the per-example decoders, one definition for the CPU (csrc/cpu/per_example.cpp)
// and the GPU (csrc/cuda/per_example.cu, one lane per target tag), so that both keep the 2-D
// kernels' tie rule (kbest.cpp) and decode identically.
#pragma once

#include <cmath>
#include <cstdint>

#include "numerics.h"  // CRFKIT_HOST_DEVICE

namespace crfkit {
#ifdef CRFKIT_CPU_ISA  // a copy of the CPU kernels (csrc/cpu/isa.h): functions of its own
inline namespace CRFKIT_CPU_ISA {
#endif

// The K best of T sorted lists: list s is lists[s * K + r] (descending in r), each entry shifted
// by shift[s * shift_stride]. A round takes the largest head, the smaller s on a tie (strict >),
// and then that list's next entry (so the earlier rank first). Writes values[r] (-inf once every
// list is spent) and codes[r] = s * K + rank for the finite ones. heads and head_values (T) are
// scratch.
template <typename scalar_t>
CRFKIT_HOST_DEVICE inline void merge_sorted_lists(const scalar_t* lists, const scalar_t* shift, int64_t shift_stride,
                                                  int64_t T, int64_t K, scalar_t* values, int64_t* codes,
                                                  int64_t* heads, scalar_t* head_values) {
  const scalar_t minus_inf = static_cast<scalar_t>(-INFINITY);
  for (int64_t s = 0; s < T; ++s) {
    heads[s] = 0;
    head_values[s] = lists[s * K] + shift[s * shift_stride];
  }
  for (int64_t r = 0; r < K; ++r) {
    scalar_t best = head_values[0];
    int64_t best_s = 0;
    for (int64_t s = 1; s < T; ++s) {
      if (head_values[s] > best) {
        best = head_values[s];
        best_s = s;
      }
    }
    if (best == minus_inf) {  // no sequence left for these slots
      for (int64_t rest = r; rest < K; ++rest) values[rest] = minus_inf;
      return;
    }
    values[r] = best;
    const int64_t rank = heads[best_s]++;
    codes[r] = best_s * K + rank;
    head_values[best_s] = rank + 1 < K ? lists[best_s * K + rank + 1] + shift[best_s * shift_stride] : minus_inf;
  }
}

#ifdef CRFKIT_CPU_ISA
}  // namespace CRFKIT_CPU_ISA
#endif
}  // namespace crfkit
