// The CPU kernel of each op: X(op, function type), one line per op. Each copy of the kernels
// (csrc/cpu/isa.h) defines crfkit::cpu::<level>::<op>_cpu with this type, in the kernel file of
// its op (README, Layout); csrc/cpu/dispatch.cpp registers, for the CPU dispatch key, the copy of
// the level in use. The types are the schemas' of csrc/crfkit.cpp.
//
// A new CPU kernel: define <op>_cpu in its file inside
//     namespace crfkit { namespace cpu { inline namespace CRFKIT_CPU_ISA { ... } } }
// (after #include "isa.h"; helpers in an anonymous namespace there), and add its line here.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <type_traits>

#define CRFKIT_CPU_KERNELS(X)                                                                      \
  X(log_partition, at::Tensor(const at::Tensor& emissions, const at::Tensor& transitions,          \
                              const at::Tensor& lengths, const at::Tensor& start,                 \
                              const at::Tensor& end))                                             \
  X(marginals, at::Tensor(const at::Tensor& emissions, const at::Tensor& transitions,              \
                          const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end)) \
  X(marginals_backward,                                                                            \
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(                                    \
        const at::Tensor& grad_marginals, const at::Tensor& emissions, const at::Tensor& transitions, \
        const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end))                \
  X(log_partition_backward,                                                                        \
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(                                    \
        const at::Tensor& grad_log_z, const at::Tensor& emissions, const at::Tensor& transitions,  \
        const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end))                \
  X(log_partition_with_marginals,                                                                  \
    std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor& emissions,                    \
                                                   const at::Tensor& transitions,                  \
                                                   const at::Tensor& lengths,                      \
                                                   const at::Tensor& start, const at::Tensor& end)) \
  X(log_partition_backward_from_marginals,                                                         \
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(                                    \
        const at::Tensor& grad_log_z, const at::Tensor& marginals,                                 \
        const at::Tensor& transition_counts, const at::Tensor& lengths))                           \
  X(expected_transition_counts,                                                                    \
    at::Tensor(const at::Tensor& emissions, const at::Tensor& transitions,                         \
               const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end))         \
  X(expected_transition_counts_backward,                                                           \
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(                                    \
        const at::Tensor& grad_counts, const at::Tensor& emissions, const at::Tensor& transitions, \
        const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end))                \
  X(viterbi, std::tuple<at::Tensor, at::Tensor>(const at::Tensor& emissions,                       \
                                                const at::Tensor& transitions,                     \
                                                const at::Tensor& lengths,                         \
                                                const at::Tensor& start, const at::Tensor& end))   \
  X(kbest_viterbi,                                                                                 \
    std::tuple<at::Tensor, at::Tensor>(const at::Tensor& emissions, const at::Tensor& transitions, \
                                       int64_t k, const at::Tensor& lengths,                       \
                                       const at::Tensor& start, const at::Tensor& end))            \
  X(kbest_viterbi_with_log_probs,                                                                  \
    std::tuple<at::Tensor, at::Tensor, at::Tensor>(                                                \
        const at::Tensor& emissions, const at::Tensor& transitions, int64_t k,                     \
        const at::Tensor& lengths, const at::Tensor& start, const at::Tensor& end))                \
  X(sequence_score, at::Tensor(const at::Tensor& emissions, const at::Tensor& transitions,         \
                               const at::Tensor& tags, const at::Tensor& lengths,                 \
                               const at::Tensor& start, const at::Tensor& end))                   \
  X(sequence_score_backward,                                                                       \
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(                                    \
        const at::Tensor& grad_scores, const at::Tensor& emissions, const at::Tensor& tags,        \
        const at::Tensor& lengths))

// Declares <op>_cpu in the enclosing namespace: CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL).
#define CRFKIT_DECLARE_CPU_KERNEL(op, ...) std::type_identity_t<__VA_ARGS__> op##_cpu;
