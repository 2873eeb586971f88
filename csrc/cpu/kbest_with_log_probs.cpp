// kbest_viterbi_with_log_probs on the CPU: the k-best op and log Z in one call, for the front
// end's k-best without gradient (crfkit/backends/compiled.py), which needs both for the
// log-probabilities.
//
// Why one op: the two ops called in turn from Python each use the threads only as far as the
// batch lets them, so a small batch leaves cores idle twice; here, with fewer sentences than
// threads, the two kernels run side by side, one task per thread. Each kernel is the CPU kernel
// of its own op (called as a function), so results are those of the two ops, bit
// for bit, and log_probs is the front end's formula (reference.log_probs_from_scores) computed
// here, which also saves its two elementwise calls.


#include <algorithm>
#include <exception>
#include <limits>
#include <tuple>

#include "../tensor.h"
#include "../checks.h"
#include "isa.h"
#include "kernels.h"
#include "per_example.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
// The CPU kernels of the two ops (kbest.cpp, log_partition.cpp), called directly: this copy's.
CRFKIT_CPU_KERNELS(CRFKIT_DECLARE_CPU_KERNEL)

namespace {

using Crf = const Tensor&;
using DecodeOutputs = std::tuple<Tensor, Tensor>;  // scores, paths

// log_probs (B, k) = scores - log Z, with log Z clamped to the lowest finite value first, so
// that missing rows (-inf) stay -inf even where log Z is -inf too: the arithmetic of
// reference.log_probs_from_scores, element for element.
Tensor log_probs_from_scores(const Tensor& scores, const Tensor& log_z) {
  auto log_probs = empty_as(scores);
  const int64_t B = scores.size(0), k = scores.size(1);
  CRFKIT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "crfkit_log_probs", [&] {
    const scalar_t* score = scores.mutable_data_ptr<scalar_t>();
    const scalar_t* z = log_z.mutable_data_ptr<scalar_t>();
    scalar_t* out = log_probs.mutable_data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      const scalar_t clamped = std::max(z[b], std::numeric_limits<scalar_t>::lowest());
      for (int64_t r = 0; r < k; ++r) out[b * k + r] = score[b * k + r] - clamped;
    }
  });
  return log_probs;
}

}  // namespace

// scores (B, k) and paths (B, k, L) as kbest_viterbi, log_probs (B, k) = scores - log Z.
std::tuple<Tensor, Tensor, Tensor> kbest_viterbi_with_log_probs_cpu(Crf emissions_in, Crf transitions_in,
                                                                                int64_t k, Crf lengths_in,
                                                                                Crf start_in, Crf end_in) {
  // Checked once, before either kernel starts, so that a bad argument raises the same message
  // whichever task would have met it first. Per-example transitions: the two kernels below send
  // them to per_example.cpp.
  const auto [emissions, transitions, lengths, start, end] =
      transitions_in.dim() == 4 ? checked_per_example_args(emissions_in, transitions_in, lengths_in, start_in, end_in)
                                : checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  CRFKIT_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  Tensor scores, paths, log_z;
  auto decode = [&] { std::tie(scores, paths) = kbest_viterbi_cpu(emissions, transitions, k, lengths, start, end); };
  auto partition = [&] { log_z = log_partition_cpu(emissions, transitions, lengths, start, end); };
  // Fewer sentences than threads: neither kernel can use every thread, so give each its own.
  // (Inside the parallel region their own parallel loops run inline, on the task's thread.)
  // A sentence with NaN / +inf emissions makes both raise the same message.
  // An exception leaves a task as a std::exception_ptr, rethrown here: thrown through torch's
  // parallel_for it would lose its type and message (csrc/tensor.h).
  if (emissions.size(0) < num_threads() && !in_parallel_region()) {
    std::exception_ptr failed[2];
    parallel_for(0, 2, 1, [&](int64_t begin, int64_t end_task) {
      for (int64_t task = begin; task < end_task; ++task) {
        try {
          task == 0 ? decode() : partition();
        } catch (...) {
          failed[task] = std::current_exception();
        }
      }
    });
    for (const auto& error : failed) {
      if (error) std::rethrow_exception(error);
    }
  } else {
    decode();
    partition();
  }
  return {scores, paths, log_probs_from_scores(scores, log_z)};
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
