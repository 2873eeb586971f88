// CPU kernel: Viterbi, with compact backpointers and the backtrace in C++ (k-best Viterbi:
// kbest.cpp; what both use: viterbi_common.h).
//
// Scores are accumulated exactly as crfkit.reference and sequence_score do it, left to right,
//     score_0 = start[y_0] + emit[0, y_0];  score_i = (score_{i-1} + trans[y_{i-1}, y_i]) + emit[i, y_i]
//     total   = score_{n-1} + end[y_{n-1}]
// so the three agree to the last bit and ties are seen identically.
//
// Tie rule (documented in crfkit/functional.py): among sequences of equal score, the one whose
// tags, read from the LAST position backwards, are lexicographically smaller comes first. It
// follows from two local choices: when merging candidates for (position i, tag t), a smaller
// predecessor tag wins a tie, and within one predecessor's list the earlier rank wins; the final
// choice over last tags prefers the smaller tag.


#include <cstdint>
#include <limits>
#include <vector>

#include "../tensor.h"
#include "../backpointers.h"
#include "../checks.h"
#include "isa.h"
#include "lanes.h"
#include "log_space.h"
#include "per_example.h"
#include "viterbi_common.h"
#include "viterbi_lanes.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
namespace {

// Viterbi for one sentence of length n >= 1. Writes path[0 .. n) and returns the best score.
template <typename scalar_t, typename bp_t>
scalar_t viterbi_sentence(const scalar_t* emit, const PaddedTransitions<scalar_t>& trans,
                          const scalar_t* start, const scalar_t* end, int64_t n, int64_t T,
                          scalar_t* __restrict__ delta, scalar_t* __restrict__ step_max,
                          typename Lanes<scalar_t>::Index* __restrict__ arg,
                          bp_t* backpointers, int64_t* path) {
  for (int64_t t = 0; t < T; ++t) delta[t] = start[t] + emit[t];
  for (int64_t i = 1; i < n; ++i) {
    // delta_i[t] = max_s (delta_{i-1}[s] + trans[s, t]) + emit_i[t]
    column_argmax<scalar_t, true>(delta, trans.rows.data(), trans.stride, T, step_max, arg);
    bp_t* bp = backpointers + i * T;
    for (int64_t t = 0; t < T; ++t) {
      delta[t] = step_max[t] + emit[i * T + t];
      bp[t] = static_cast<bp_t>(arg[t]);
    }
  }
  scalar_t best = delta[0] + end[0];
  int64_t tag = 0;
  for (int64_t t = 1; t < T; ++t) {
    if (delta[t] + end[t] > best) {
      best = delta[t] + end[t];
      tag = t;
    }
  }
  if (best == neg_inf<scalar_t>()) return best;  // every sequence forbidden: path stays -1
  for (int64_t i = n - 1; i >= 0; --i) {
    path[i] = tag;
    if (i > 0) tag = backpointers[i * T + tag];
  }
  return best;
}

}  // namespace

// scores (B,), paths (B, L) int64 (-1 at padded positions and where no sequence is allowed).
std::tuple<Tensor, Tensor> viterbi_cpu(const Tensor& emissions_in,
                                               const Tensor& transitions_in,
                                               const Tensor& lengths_in, const Tensor& start_in,
                                               const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return viterbi_per_example(emissions_in, transitions_in, lengths_in, start_in, end_in);
  }
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  auto paths = full({B, L}, -1, options_of(lengths));
  auto scores = empty({B}, options_of(emissions));
  std::vector<char> bad(B, 0);
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_viterbi", [&] {
    const scalar_t* emit = emissions.mutable_data_ptr<scalar_t>();
    const scalar_t* trans = transitions.mutable_data_ptr<scalar_t>();
    const scalar_t* st = start.mutable_data_ptr<scalar_t>();
    const scalar_t* en = end.mutable_data_ptr<scalar_t>();
    const int64_t* len = lengths.mutable_data_ptr<int64_t>();
    int64_t* path = paths.mutable_data_ptr<int64_t>();
    scalar_t* score = scores.mutable_data_ptr<scalar_t>();
    dispatch_backpointer_type(T, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      // Several sentences per vector (viterbi_lanes.h) where that is faster: same results, bit
      // for bit. Otherwise (few sentences for the threads) one sentence at a time, tags in lanes.
      const LanePlan plan = plan_viterbi_lanes<scalar_t, bp_t>(len, B, L, T);
      if (plan.use_lanes) {
        viterbi_lanes<scalar_t, bp_t>(plan, emit, trans, len, st, en, B, L, T, path, score, bad);
        return;
      }
      const PaddedTransitions<scalar_t> padded_trans(trans, T);
      parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
        std::vector<scalar_t> delta(T), step_max(padded_trans.stride);
        std::vector<typename Lanes<scalar_t>::Index> arg(padded_trans.stride);
        std::vector<bp_t> backpointers(std::max<int64_t>(L, 1) * T);
        for (int64_t b = b_begin; b < b_end; ++b) {
          const int64_t n = len[b];
          const scalar_t* emit_b = emit + b * L * T;
          if (has_nan_or_posinf(emit_b, n * T)) {
            bad[b] = 1;
            continue;
          }
          score[b] = n == 0 ? scalar_t(0)  // the empty sequence
                            : viterbi_sentence(emit_b, padded_trans, st, en, n, T, delta.data(),
                                               step_max.data(), arg.data(), backpointers.data(),
                                               path + b * L);
        }
      });
    });
  });
  raise_if_bad_emissions(bad);
  return {scores, paths};
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
