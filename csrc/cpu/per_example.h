// The CPU kernels for per-example transitions (per_example.cpp): transitions (B, Lt, T, T) with
// Lt = 1 (one matrix per sentence) or Lt = L (one per position: transitions[b, i, s, t] scores
// y_{i-1} = s -> y_i = t; transitions[:, 0] is never read), start and end (B, T). Each op's CPU
// entry point sends 4-D transitions (4-D transition_counts for
// log_partition_backward_from_marginals) here first; the 2-D path is left as it is. The
// arguments and results are those of the op's schema (csrc/crfkit.cpp), with the per-example
// shapes where the transitions are involved (see each function).
#pragma once

#include <tuple>

#include "../checks.h"
#include "../tensor.h"
#include "isa.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {

// The CRF arguments with per-example transitions, dense and checked (shapes, dtypes, devices,
// lengths in [0, L], no NaN / +inf in transitions, start, end): checked_cpu_args' counterpart.
CrfArgs checked_per_example_args(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                 const Tensor& start, const Tensor& end);

// log Z (B,).
Tensor log_partition_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                 const Tensor& start, const Tensor& end);
// P(y_i = t | x): (B, L, T).
Tensor marginals_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                             const Tensor& start, const Tensor& end);
// The gradients of sum_b grad_log_z[b] log Z[b], per example: emissions (B, L, T), transitions
// (B, Lt, T, T), start (B, T), end (B, T).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_per_example(
    const Tensor& grad_log_z, const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
    const Tensor& start, const Tensor& end);
// log Z (B,), marginals (B, L, T), transition counts of the transitions' shape (B, Lt, T, T):
// summed over positions for Lt = 1, per position for Lt = L.
std::tuple<Tensor, Tensor, Tensor> log_partition_with_marginals_per_example(
    const Tensor& emissions, const Tensor& transitions, const Tensor& lengths, const Tensor& start,
    const Tensor& end);
// From log_partition_with_marginals_per_example's marginals and counts (B, Lt, T, T): the
// gradients per example, emissions (B, L, T), transitions (B, Lt, T, T), start (B, T), end (B, T).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_from_marginals_per_example(
    const Tensor& grad_log_z, const Tensor& marginals, const Tensor& transition_counts, const Tensor& lengths);
// E[number of s -> t transitions] per sentence, summed over positions (also for Lt = L): (B, T, T).
Tensor expected_transition_counts_per_example(const Tensor& emissions, const Tensor& transitions,
                                              const Tensor& lengths, const Tensor& start, const Tensor& end);
// scores (B,), paths (B, L).
std::tuple<Tensor, Tensor> viterbi_per_example(const Tensor& emissions, const Tensor& transitions,
                                               const Tensor& lengths, const Tensor& start, const Tensor& end);
// scores (B, k), paths (B, k, L).
std::tuple<Tensor, Tensor> kbest_viterbi_per_example(const Tensor& emissions, const Tensor& transitions,
                                                     int64_t k, const Tensor& lengths, const Tensor& start,
                                                     const Tensor& end);
// (B, N) for tags (B, N, L).
Tensor sequence_score_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& tags,
                                  const Tensor& lengths, const Tensor& start, const Tensor& end);

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
