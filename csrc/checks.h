// Argument checks shared by every crfkit kernel (CPU and, later, CUDA).
//
// The Python front end (crfkit/functional.py) validates user input first and gives the
// friendliest messages; these checks are the second line for code that calls the
// registered ops directly (torch.ops.crfkit.*), so a wrong call raises instead of crashing.
#pragma once

#include "tensor.h"

#include <cstring>
#include <type_traits>


namespace crfkit {
#ifdef CRFKIT_CPU_ISA  // a copy of the CPU kernels (csrc/cpu/isa.h): functions of its own
inline namespace CRFKIT_CPU_ISA {
#endif

// emissions (B, L, T), float32 or float64 (the dtypes the kernels are built for).
inline void check_emissions_argument(const Tensor& emissions) {
  CRFKIT_CHECK_VALUE(emissions.dim() == 3, "crfkit: emissions must be (batch, seq_len, num_tags), got ",
                    emissions.dim(), " dimensions");
  CRFKIT_CHECK_TYPE(emissions.scalar_type() == kFloat || emissions.scalar_type() == kDouble,
                   "crfkit: the compiled ops take float32 or float64 emissions, got ",
                   emissions.scalar_type(), " (crfkit.functional upcasts float16/bfloat16)");
}

// tags (B, N, L) int64 on the device of emissions (B, L, T); the values are checked by the
// kernels, which read them.
inline void check_tags(const Tensor& tags, const Tensor& emissions) {
  CRFKIT_CHECK_VALUE(tags.dim() == 3 && tags.size(0) == emissions.size(0) && tags.size(2) == emissions.size(1),
                    "crfkit: tags must be (batch, num_sequences, seq_len) = (", emissions.size(0), ", N, ",
                    emissions.size(1), "), got ", tags.sizes());
  CRFKIT_CHECK_TYPE(tags.scalar_type() == kLong, "crfkit: tags must be int64, got ", tags.scalar_type());
  CRFKIT_CHECK(tags.device() == emissions.device(), "crfkit: tags must be on the device of emissions");
}

// Row (b, j) of tags, read on the host (CPU tensors only): every tag within its length n in [0, T).
inline void check_tag_row(const int64_t* row, int64_t n, int64_t T, int64_t b, int64_t j) {
  for (int64_t i = 0; i < n; ++i) {
    CRFKIT_CHECK_VALUE(row[i] >= 0 && row[i] < T, "crfkit: tags[", b, ", ", j, ", ", i, "] = ", row[i],
                " is not a tag index in [0, ", T, ")");
  }
}

// Per-example transitions (batch, Lt, num_tags, num_tags), and the transition counts of their
// shape, are taken by the per-example kernels (csrc/cpu/per_example.cpp, csrc/cuda/per_example.cu)
// only: `x` is the argument `name` of `who`, the code that refuses them.
inline void check_not_per_example(const Tensor& x, const char* name, const char* who) {
  CRFKIT_CHECK(x.dim() != 4, "crfkit: per-example ", name, " (batch, Lt, num_tags, num_tags) are not supported by ",
               who, ", got ", name, " of shape ", x.sizes());
}

// transition_counts (B, Lt, T, T) with Lt = 1 or L, for marginals (B, L, T): the per-example
// form of log_partition_backward_from_marginals' counts (shape only; dtype and device are
// check_argument_like's).
inline void check_per_example_counts_shape(const Tensor& counts, const Tensor& marginals) {
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2);
  const int64_t Lt = counts.dim() == 4 ? counts.size(1) : -1;
  CRFKIT_CHECK_VALUE(counts.dim() == 4 && counts.size(0) == B && (Lt == 1 || Lt == L) && counts.size(2) == T &&
                         counts.size(3) == T,
                     "crfkit: transition_counts must be (batch, num_tags, num_tags) or, per example, (batch, Lt, "
                     "num_tags, num_tags) with Lt = 1 or seq_len: (", B, ", 1 or ", L, ", ", T, ", ", T, "), got ",
                     counts.sizes());
}

// lengths (B,) int64 on the device of `like` (the op's emissions, or its marginals).
inline void check_lengths_argument(const Tensor& lengths, int64_t B, const Tensor& like) {
  CRFKIT_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == B, "crfkit: lengths must be (batch,) = (",
                    B, ",), got ", lengths.sizes());
  CRFKIT_CHECK_TYPE(lengths.scalar_type() == kLong, "crfkit: lengths must be int64, got ",
                   lengths.scalar_type());
  CRFKIT_CHECK(lengths.device() == like.device(), "crfkit: lengths must be on the device of the scores (",
              like.device(), "), got ", lengths.device());
}

// The extra tensors of the backward ops (an upstream gradient, saved marginals or counts):
// exactly `sizes` (ValueError; `layout` names the dimensions), the dtype of `like` (TypeError),
// its device (RuntimeError).
inline void check_argument_like(const Tensor& x, const char* name, const char* layout,
                                Sizes sizes, const Tensor& like, const char* like_name) {
  CRFKIT_CHECK_VALUE(x.sizes() == sizes, "crfkit: ", name, " must be ", layout, " = ", sizes, ", got ",
                    x.sizes());
  CRFKIT_CHECK_TYPE(x.scalar_type() == like.scalar_type(), "crfkit: ", name, " must have the dtype of ",
                   like_name, " (", like.scalar_type(), "), got ", x.scalar_type());
  CRFKIT_CHECK(x.device() == like.device(), "crfkit: ", name, " must be on the device of ", like_name, " (",
              like.device(), "), got ", x.device());
}

// The arguments of log_partition_backward_from_marginals (CPU and CUDA, shared and per-example
// kernels): marginals (B, L, T) float32 / float64, transition_counts (B, T, T) or, per example,
// (B, Lt, T, T), and grad_log_z (B,) like them, lengths (B,) int64 on their device. The lengths'
// values are checked by each device's kernel code.
inline void check_backward_from_marginals_arguments(const Tensor& grad_log_z, const Tensor& marginals,
                                                    const Tensor& counts, const Tensor& lengths) {
  CRFKIT_CHECK_VALUE(marginals.dim() == 3, "crfkit: marginals must be (batch, seq_len, num_tags), got ",
                    marginals.dim(), " dimensions");
  CRFKIT_CHECK_TYPE(marginals.scalar_type() == kFloat || marginals.scalar_type() == kDouble,
                   "crfkit: marginals must be float32 or float64, got ", marginals.scalar_type());
  const int64_t B = marginals.size(0), T = marginals.size(2);
  if (counts.dim() == 4) {
    check_per_example_counts_shape(counts, marginals);
    check_argument_like(counts, "transition_counts", "(batch, Lt, num_tags, num_tags)", counts.sizes(), marginals,
                        "marginals");
  } else {
    check_argument_like(counts, "transition_counts", "(batch, num_tags, num_tags)", {B, T, T}, marginals,
                        "marginals");
  }
  check_argument_like(grad_log_z, "grad_log_z", "(batch,)", {B}, marginals, "marginals");
  check_lengths_argument(lengths, B, marginals);
}

// transitions, start and end of the dtype of emissions; every argument on its device.
inline void check_dtypes_and_devices(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                     const Tensor& start, const Tensor& end) {
  for (const auto* t : {&transitions, &start, &end}) {
    CRFKIT_CHECK_TYPE(t->scalar_type() == emissions.scalar_type(),
                "crfkit: transitions, start and end must have the dtype of emissions (",
                emissions.scalar_type(), "), got ", t->scalar_type());
  }
  for (const auto* t : {&transitions, &start, &end, &lengths}) {
    CRFKIT_CHECK(t->device() == emissions.device(),
                "crfkit: every argument must be on the device of emissions (", emissions.device(),
                "), got one on ", t->device());
  }
}

// Shapes every op agrees on: emissions (B, L, T), transitions (T, T), start (T,),
// end (T,), lengths (B,) int64. Raises with the argument's name (TypeError for a wrong dtype,
// ValueError for a wrong shape or value, RuntimeError for a wrong device).
inline void check_crf_inputs(const Tensor& emissions, const Tensor& transitions,
                             const Tensor& lengths, const Tensor& start,
                             const Tensor& end) {
  check_emissions_argument(emissions);
  const int64_t B = emissions.size(0);
  const int64_t T = emissions.size(2);
  CRFKIT_CHECK_VALUE(T >= 1, "crfkit: emissions must have at least one tag (num_tags >= 1)");
  CRFKIT_CHECK_VALUE(transitions.dim() == 2 && transitions.size(0) == T && transitions.size(1) == T,
              "crfkit: transitions must be (num_tags, num_tags) = (", T, ", ", T, "), got ",
              transitions.sizes());
  CRFKIT_CHECK_VALUE(start.dim() == 1 && start.size(0) == T, "crfkit: start must be (num_tags,) = (", T,
              ",), got ", start.sizes());
  CRFKIT_CHECK_VALUE(end.dim() == 1 && end.size(0) == T, "crfkit: end must be (num_tags,) = (", T,
              ",), got ", end.sizes());
  check_lengths_argument(lengths, B, emissions);
  check_dtypes_and_devices(emissions, transitions, lengths, start, end);
}

// The shapes, dtypes and devices of per-example CRF arguments: emissions (B, L, T), transitions
// (B, Lt, T, T) with Lt = 1 or L, start and end (B, T), lengths (B,) int64 (values are each
// device's kernels' to check).
inline void check_per_example_inputs(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                     const Tensor& start, const Tensor& end) {
  check_emissions_argument(emissions);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  CRFKIT_CHECK_VALUE(T >= 1, "crfkit: emissions must have at least one tag (num_tags >= 1)");
  const Tensor& tr = transitions;
  CRFKIT_CHECK_VALUE(tr.dim() == 4 && tr.size(0) == B && (tr.size(1) == 1 || tr.size(1) == L) && tr.size(2) == T &&
                         tr.size(3) == T,
                     "crfkit: transitions must be (num_tags, num_tags) or, per example, (batch, Lt, num_tags, "
                     "num_tags) with Lt = 1 or seq_len: (", B, ", 1 or ", L, ", ", T, ", ", T, "), got ", tr.sizes());
  for (const auto* t : {&start, &end}) {
    CRFKIT_CHECK_VALUE(t->dim() == 2 && t->size(0) == B && t->size(1) == T, "crfkit: ", t == &start ? "start" : "end",
                       " must be (batch, num_tags) = (", B, ", ", T,
                       ") when transitions are per example (batch, Lt, num_tags, num_tags), got ", t->sizes());
  }
  check_lengths_argument(lengths, B, emissions);
  check_dtypes_and_devices(emissions, transitions, lengths, start, end);
}

// lengths[b] in [0, L] for every b; read on the host (CPU tensors only).
inline void check_lengths_cpu(const Tensor& lengths, int64_t max_len) {
  const int64_t* len = lengths.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < lengths.size(0); ++b) {
    CRFKIT_CHECK_VALUE(len[b] >= 0 && len[b] <= max_len, "crfkit: lengths[", b, "] = ", len[b],
                " is outside [0, seq_len = ", max_len, "]");
  }
}

// Scores may be -inf (forbidden) but never NaN or +inf: +inf makes log Z infinite and
// every probability NaN, and NaN would silently poison the whole sentence.
// Tested on the bits (integer compares vectorise; floating-point compares with a NaN operand
// may trap, so the compiler keeps them scalar): with the sign cleared, NaN is above the bits of
// +inf; +inf itself is the one positive pattern equal to them.
template <typename scalar_t>
inline bool has_nan_or_posinf(const scalar_t* x, int64_t n) {
  using bits_t = std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>;
  constexpr bits_t kInf = sizeof(scalar_t) == 4 ? bits_t(0x7f800000u) : bits_t(0x7ff0000000000000ull);
  constexpr bits_t kMagnitude = ~bits_t(0) >> 1;
  bits_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bits_t u;
    std::memcpy(&u, x + i, sizeof u);
    bad |= static_cast<bits_t>(((u & kMagnitude) > kInf) | (u == kInf));
  }
  return bad != 0;
}

inline void check_parameters_finite_cpu(const Tensor& transitions, const Tensor& start,
                                        const Tensor& end) {
  CRFKIT_DISPATCH_FLOATING_TYPES(transitions.scalar_type(), "crfkit_check_parameters", [&] {
    CRFKIT_CHECK_VALUE(!has_nan_or_posinf(transitions.mutable_data_ptr<scalar_t>(), transitions.numel()),
                "crfkit: transitions contains NaN or +inf (use -inf to forbid a transition)");
    CRFKIT_CHECK_VALUE(!has_nan_or_posinf(start.mutable_data_ptr<scalar_t>(), start.numel()),
                "crfkit: start contains NaN or +inf (use -inf to forbid a first tag)");
    CRFKIT_CHECK_VALUE(!has_nan_or_posinf(end.mutable_data_ptr<scalar_t>(), end.numel()),
                "crfkit: end contains NaN or +inf (use -inf to forbid a last tag)");
  });
}

// Raised after a parallel loop that flagged sentences whose real positions hold NaN or +inf
// emissions (padded positions are never read, so garbage there is harmless).
inline void raise_if_bad_emissions(const std::vector<char>& bad_sentence) {
  for (size_t b = 0; b < bad_sentence.size(); ++b) {
    CRFKIT_CHECK_VALUE(!bad_sentence[b], "crfkit: emissions[", b,
                "] contains NaN or +inf within its length (use -inf to forbid a tag)");
  }
}

// noise (seq_len, batch, num_samples, num_tags) of the emissions' dtype and device: the standard
// Gumbels of the samplers (csrc/cpu/sampling.cpp, csrc/cuda/sampling.cu).
inline void check_noise_argument(const Tensor& noise, const Tensor& emissions) {
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  CRFKIT_CHECK_VALUE(noise.dim() == 4 && noise.size(0) == L && noise.size(1) == B && noise.size(3) == T,
                     "crfkit: noise must be (seq_len, batch, num_samples, num_tags) = (", L, ", ", B, ", n, ", T,
                     "), got ", noise.sizes());
  CRFKIT_CHECK_TYPE(noise.scalar_type() == emissions.scalar_type(), "crfkit: noise must have the dtype of emissions (",
                    emissions.scalar_type(), "), got ", noise.scalar_type());
  CRFKIT_CHECK(noise.device() == emissions.device(), "crfkit: noise must be on the device of emissions (",
               emissions.device(), "), got ", noise.device());
}

// The CRF arguments of a CPU op, dense and checked. The raw ops accept any strides (expanded
// tensors included): `.as_contiguous()` copies only where needed, and the kernels index dense memory.
struct CrfArgs {
  Tensor emissions, transitions, lengths, start, end;
};

inline CrfArgs checked_cpu_args(const Tensor& emissions, const Tensor& transitions,
                                const Tensor& lengths, const Tensor& start,
                                const Tensor& end) {
  CrfArgs a{as_contiguous(emissions), as_contiguous(transitions), as_contiguous(lengths), as_contiguous(start),
            as_contiguous(end)};
  check_crf_inputs(a.emissions, a.transitions, a.lengths, a.start, a.end);
  check_lengths_cpu(a.lengths, a.emissions.size(1));
  check_parameters_finite_cpu(a.transitions, a.start, a.end);
  return a;
}

#ifdef CRFKIT_CPU_ISA
}  // namespace CRFKIT_CPU_ISA
#endif
}  // namespace crfkit
