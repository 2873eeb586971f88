// What the two forward-backward kernels (forward_backward.cuh, forward_backward_registers.cuh)
// share with each other and with their launch (log_partition.cu): the op's outputs, the
// transition tables, the launch parameters, the end of the forward pass and the register
// kernels' lane dispatch (also used by the chunked Viterbi in viterbi.cu).
//
// Included by log_partition.cu and, through viterbi_chunked.cuh, viterbi.cu: the anonymous
// namespace gives each translation unit its own copy of the kernels it instantiates.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace crfkit {
namespace cuda {
namespace {

// kBackward: the gradients for a given grad_log_z, summed over the batch;
// kWithMarginals: log Z, and the gradients for grad_log_z = 1 kept per sentence.
enum class Output { kLogPartition, kMarginals, kBackward, kWithMarginals };

// Transition tables, one array of scalars:
//   [0, T*T)             e_col[s * T + t]   = exp(trans[s, t] - col_max[t])  (0 if col_max = -inf)
//   [T*T, T*T + T)       col_max[t]
//   [T*T + T, 2T*T + T)  e_row_t[t * T + s] = exp(trans[s, t] - row_max[s])  (0 if row_max = -inf)
//   [2T*T + T, 2T*T+2T)  row_max[s]
// Both tables are indexed [other][own] so that the lanes of a group, which own consecutive
// tags, read consecutive addresses.
__host__ __device__ inline int64_t table_elements(int64_t T) { return 2 * T * T + 2 * T; }

// The kernel also does the call's set-up, so that it costs no launch of its own: the input
// checks (InputChecks) and zeroing `clear_count` ints at `clear` (the chunked path's flags).
template <typename scalar_t>
__global__ void transition_tables_kernel(const scalar_t* transitions, int T, scalar_t* tables,
                                         const InputChecks<scalar_t> checks, int* clear, int64_t clear_count) {
  check_inputs(checks);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < clear_count; i += (int64_t)gridDim.x * blockDim.x) {
    clear[i] = 0;
  }
  for (int line = blockIdx.x * blockDim.x + threadIdx.x; line < 2 * T; line += gridDim.x * blockDim.x) {
    const bool column = line < T;  // lines [0, T): columns t; [T, 2T): rows s
    const int own = column ? line : line - T;
    auto at = [&](int other) {
      return column ? transitions[other * T + own] : transitions[own * T + other];
    };
    scalar_t line_max = neg_inf<scalar_t>();
    for (int other = 0; other < T; ++other) line_max = max_(line_max, at(other));
    scalar_t* scaled = column ? tables : tables + T * T + T;
    (column ? tables + T * T : tables + 2 * T * T + T)[own] = line_max;
    for (int other = 0; other < T; ++other) {
      scaled[other * T + own] = line_max == neg_inf<scalar_t>() ? scalar_t(0) : exp_(at(other) - line_max);
    }
  }
}

template <typename scalar_t>
struct FbParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  const scalar_t* grad_log_z;   // (B,), kBackward only
  const scalar_t* tables;       // table_elements(T), global
  scalar_t* log_z;              // (B,), kLogPartition and kWithMarginals
  scalar_t* rows;               // (B, L, T): alpha rows, then the (weighted) marginals
  double* offsets;              // (slots, L), kBackward and kWithMarginals
  scalar_t* partials;           // (slots, T*T + 2T): per-group gradient sums, kBackward only
  scalar_t* counts;             // (B, T, T): expected transition counts, kWithMarginals only
  unsigned char* arena_workspace;  // (slots, arena_bytes) when the arenas are not in shared memory
  long long* status;
  int64_t batch, max_len;
  int num_tags;
  SharedPlan plan;
  size_t arena_bytes, accumulator_bytes;  // per group, aligned
};


// The end of a sentence's forward pass, shared by both kernels: log Z = offset + m + log(sum)
// (m, sum: the group's max and sum of exp(alpha_hat + end - m)); 0 for an empty sentence, -inf
// when every sequence is forbidden. Reports bad emissions found by any lane of the group, writes
// log Z where the op returns it, and returns whether the sentence had bad emissions.
template <typename scalar_t, Output kOut>
__device__ __forceinline__ bool finish_forward(const FbParams<scalar_t>& p, int64_t b, bool has_sentence, int64_t n,
                                               double offset, scalar_t m, scalar_t sum, bool bad, int lanes,
                                               int lane, double& log_z) {
  log_z = 0;  // the empty sequence of a length-0 sentence
  if (n > 0) {
    log_z = (offset == -CUDART_INF || m == neg_inf<scalar_t>()) ? -CUDART_INF
                                                                : offset + static_cast<double>(m + log_(sum));
  }
  bad = group_max(static_cast<int>(bad), lanes) != 0;
  if (bad && lane == 0) report(p.status, kBadEmissions, b);
  if (kOut == Output::kLogPartition || kOut == Output::kWithMarginals) {
    if (has_sentence && lane == 0) p.log_z[b] = static_cast<scalar_t>(log_z);
  }
  return bad;
}

// The weight of a sentence's gradients (its upstream gradient of log Z; 1 for the ops that
// return unweighted marginals), and whether its backward pass is skipped: empty, bad emissions,
// every sequence forbidden, or nothing to propagate. Skipped sentences get all-zero gradients
// (no NaN).
template <typename scalar_t, Output kOut>
__device__ __forceinline__ scalar_t gradient_weight(const FbParams<scalar_t>& p, int64_t b, bool has_sentence,
                                                    int64_t n, bool bad, double log_z, bool& skip) {
  const scalar_t g = kOut == Output::kBackward ? (has_sentence ? p.grad_log_z[b] : scalar_t(0)) : scalar_t(1);
  skip = n == 0 || bad || log_z == -CUDART_INF || g == 0;
  return g;
}

template <typename scalar_t>
constexpr int register_max_tags() { return sizeof(scalar_t) == 4 ? 32 : 16; }

// Lanes per sentence of the register kernels (sequential and chunked) for T <= register_max_tags
// tags: the power of two >= T, at least 8 (the kernels are instantiated for 8, 16 and
// register_max_tags lanes only).
inline int register_lanes(int64_t T) { return std::max(8, lanes_per_sentence(T)); }

// Calls f(std::integral_constant<int, kLanes>) with the register kernels' lane count for T tags:
// the one place that maps a run-time lane count to the kernels' template argument.
template <typename scalar_t, typename F>
void dispatch_register_lanes(int64_t T, F&& f) {
  const int lanes = register_lanes(T);
  if (lanes == 8) {
    f(std::integral_constant<int, 8>{});
  } else if (lanes == 16) {
    f(std::integral_constant<int, 16>{});
  } else {
    f(std::integral_constant<int, register_max_tags<scalar_t>()>{});
  }
}

}  // namespace
}  // namespace cuda
}  // namespace crfkit
