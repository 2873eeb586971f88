// The CPU kernel of each op: X(op, function type), one line per op. Each copy of the kernels
// (csrc/cpu/isa.h) defines crfkit::cpu::<level>::<op>_cpu with this type, in the kernel file of
// its op (README, Layout); csrc/cpu/dispatch.cpp registers, for the CPU dispatch key, the copy of
// the level in use. The types are the schemas' of csrc/crfkit.cpp.
//
// A new CPU kernel: define <op>_cpu in its file inside
//     namespace crfkit { namespace cpu { inline namespace CRFKIT_CPU_ISA { ... } } }
// (after #include "isa.h"; helpers in an anonymous namespace there), and add its line here.
#pragma once

#include "../tensor.h"


#include <tuple>
#include <type_traits>

#define CRFKIT_CPU_KERNELS(X)                                                                      \
  X(log_partition, Tensor(const Tensor& emissions, const Tensor& transitions,          \
                              const Tensor& lengths, const Tensor& start,                 \
                              const Tensor& end))                                             \
  X(marginals, Tensor(const Tensor& emissions, const Tensor& transitions,              \
                          const Tensor& lengths, const Tensor& start, const Tensor& end)) \
  X(marginals_backward,                                                                            \
    std::tuple<Tensor, Tensor, Tensor, Tensor>(                                    \
        const Tensor& grad_marginals, const Tensor& emissions, const Tensor& transitions, \
        const Tensor& lengths, const Tensor& start, const Tensor& end))                \
  X(log_partition_backward,                                                                        \
    std::tuple<Tensor, Tensor, Tensor, Tensor>(                                    \
        const Tensor& grad_log_z, const Tensor& emissions, const Tensor& transitions,  \
        const Tensor& lengths, const Tensor& start, const Tensor& end))                \
  X(log_partition_with_marginals,                                                                  \
    std::tuple<Tensor, Tensor, Tensor>(const Tensor& emissions,                    \
                                                   const Tensor& transitions,                  \
                                                   const Tensor& lengths,                      \
                                                   const Tensor& start, const Tensor& end)) \
  X(log_partition_backward_from_marginals,                                                         \
    std::tuple<Tensor, Tensor, Tensor, Tensor>(                                    \
        const Tensor& grad_log_z, const Tensor& marginals,                                 \
        const Tensor& transition_counts, const Tensor& lengths))                           \
  X(expected_transition_counts,                                                                    \
    Tensor(const Tensor& emissions, const Tensor& transitions,                         \
               const Tensor& lengths, const Tensor& start, const Tensor& end))         \
  X(expected_transition_counts_backward,                                                           \
    std::tuple<Tensor, Tensor, Tensor, Tensor>(                                    \
        const Tensor& grad_counts, const Tensor& emissions, const Tensor& transitions, \
        const Tensor& lengths, const Tensor& start, const Tensor& end))                \
  X(viterbi, std::tuple<Tensor, Tensor>(const Tensor& emissions,                       \
                                                const Tensor& transitions,                     \
                                                const Tensor& lengths,                         \
                                                const Tensor& start, const Tensor& end))   \
  X(kbest_viterbi,                                                                                 \
    std::tuple<Tensor, Tensor>(const Tensor& emissions, const Tensor& transitions, \
                                       int64_t k, const Tensor& lengths,                       \
                                       const Tensor& start, const Tensor& end))            \
  X(kbest_viterbi_with_log_probs,                                                                  \
    std::tuple<Tensor, Tensor, Tensor>(                                                \
        const Tensor& emissions, const Tensor& transitions, int64_t k,                     \
        const Tensor& lengths, const Tensor& start, const Tensor& end))                \
  X(sequence_score, Tensor(const Tensor& emissions, const Tensor& transitions,         \
                               const Tensor& tags, const Tensor& lengths,                 \
                               const Tensor& start, const Tensor& end))                   \
  X(sequence_score_backward,                                                                       \
    std::tuple<Tensor, Tensor, Tensor, Tensor>(                                    \
        const Tensor& grad_scores, const Tensor& emissions, const Tensor& tags,        \
        const Tensor& lengths))                                                                    \
  X(sample_with_replacement,                                                                       \
    Tensor(const Tensor& emissions, const Tensor& transitions, const Tensor& noise,                \
           const Tensor& lengths, const Tensor& start, const Tensor& end))                \
  X(sample_without_replacement,                                                                    \
    Tensor(const Tensor& emissions, const Tensor& transitions, const Tensor& noise,                \
           const Tensor& lengths, const Tensor& start, const Tensor& end))

// Declares <op>_cpu in the enclosing namespace: CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL).
#define CRFKIT_DECLARE_CPU_KERNEL(op, ...) std::type_identity_t<__VA_ARGS__> op##_cpu;
