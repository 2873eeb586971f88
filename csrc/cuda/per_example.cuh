// The CUDA kernels for per-example transitions (per_example.cu), csrc/cpu/per_example.h's
// counterparts: transitions (B, Lt, T, T) with Lt = 1 or L, start and end (B, T). Each op's CUDA
// entry point sends 4-D transitions (4-D transition_counts for
// log_partition_backward_from_marginals) here; sequence_score.cu and sampling.cu take them in
// their own kernels. Arguments and results are the op's schema's (csrc/crfkit.cpp), with the
// per-example shapes where the transitions are involved.
#pragma once

#include <tuple>

#include "../tensor.h"

namespace crfkit {
namespace cuda {

// log Z (B,).
Tensor log_partition_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                 const Tensor& start, const Tensor& end);
// P(y_i = t | x): (B, L, T).
Tensor marginals_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                             const Tensor& start, const Tensor& end);
// The gradients of sum_b grad_log_z[b] log Z[b]: emissions (B, L, T), transitions (B, Lt, T, T),
// start (B, T), end (B, T).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_per_example(
    const Tensor& grad_log_z, const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
    const Tensor& start, const Tensor& end);
// log Z (B,), marginals (B, L, T), transition counts (B, Lt, T, T): summed over positions for
// Lt = 1, per position for Lt = L.
std::tuple<Tensor, Tensor, Tensor> log_partition_with_marginals_per_example(
    const Tensor& emissions, const Tensor& transitions, const Tensor& lengths, const Tensor& start,
    const Tensor& end);
// From those marginals and counts (B, Lt, T, T): the gradients per example.
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_from_marginals_per_example(
    const Tensor& grad_log_z, const Tensor& marginals, const Tensor& transition_counts, const Tensor& lengths);
// E[number of s -> t transitions] per sentence, summed over positions (also for Lt = L): (B, T, T).
Tensor expected_transition_counts_per_example(const Tensor& emissions, const Tensor& transitions,
                                              const Tensor& lengths, const Tensor& start, const Tensor& end);
// scores (B,), paths (B, L).
std::tuple<Tensor, Tensor> viterbi_per_example(const Tensor& emissions, const Tensor& transitions,
                                               const Tensor& lengths, const Tensor& start, const Tensor& end);
// scores (B, k), paths (B, k, L).
std::tuple<Tensor, Tensor> kbest_viterbi_per_example(const Tensor& emissions, const Tensor& transitions, int64_t k,
                                                     const Tensor& lengths, const Tensor& start, const Tensor& end);
// scores (B, k), paths (B, k, L), log_probs (B, k).
std::tuple<Tensor, Tensor, Tensor> kbest_viterbi_with_log_probs_per_example(
    const Tensor& emissions, const Tensor& transitions, int64_t k, const Tensor& lengths, const Tensor& start,
    const Tensor& end);

}  // namespace cuda
}  // namespace crfkit
