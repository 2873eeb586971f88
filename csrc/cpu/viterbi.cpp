// CPU kernels: Viterbi and exact k-best Viterbi, with compact backpointers and the backtrace in C++.
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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "../backpointers.h"
#include "../checks.h"
#include "kbest_lanes.h"
#include "lanes.h"
#include "log_space.h"
#include "viterbi_lanes.h"

namespace crfkit {
namespace cpu {
namespace {

// The transitions with each row padded to whole lane vectors (-inf in the padding, so padded
// lanes never win a max), for the in-register column argmax below.
template <typename scalar_t>
struct PaddedTransitions {
  int64_t T, stride;
  std::vector<scalar_t> rows;  // [s][t], T x stride
  PaddedTransitions(const scalar_t* trans, int64_t num_tags)
      : T(num_tags), stride(padded_to_lanes<scalar_t>(num_tags)),
        rows(num_tags * stride, neg_inf<scalar_t>()) {
    for (int64_t s = 0; s < T; ++s) std::copy(trans + s * T, trans + (s + 1) * T, &rows[s * stride]);
  }
};

// The max over predecessors that Viterbi and k-best both do, for all tags at once:
//     best[t] = max_s (offsets[s] + rows[s * stride + t])   (no offsets: max_s rows[s * stride + t])
//     arg[t]  = the first s that reaches it (strict comparison: the smaller predecessor wins a tie)
// for t < stride; rows are padded with -inf. Predecessors s outside, tags t inside (independent
// lanes). For T up to 8 lane vectors the running maxima and argmaxes stay in registers for the
// whole loop over s (a loop over memory stores and reloads them for every s).
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

template <typename scalar_t, bool kOffsets>
void column_argmax(const scalar_t* offsets, const scalar_t* rows, int64_t stride, int64_t T,
                   scalar_t* __restrict__ best, typename Lanes<scalar_t>::Index* __restrict__ arg) {
  switch (stride / Lanes<scalar_t>::kCount) {
#define CRFKIT_COLUMN_ARGMAX_CASE(V) \
  case V: return column_argmax_in_registers<scalar_t, kOffsets, V>(offsets, rows, stride, T, best, arg);
    CRFKIT_COLUMN_ARGMAX_CASE(1) CRFKIT_COLUMN_ARGMAX_CASE(2) CRFKIT_COLUMN_ARGMAX_CASE(3)
    CRFKIT_COLUMN_ARGMAX_CASE(4) CRFKIT_COLUMN_ARGMAX_CASE(5) CRFKIT_COLUMN_ARGMAX_CASE(6)
    CRFKIT_COLUMN_ARGMAX_CASE(7) CRFKIT_COLUMN_ARGMAX_CASE(8)
#undef CRFKIT_COLUMN_ARGMAX_CASE
    default: break;  // more tags than registers: the same loop over memory
  }
  for (int64_t t = 0; t < stride; ++t) {
    best[t] = rows[t];
    if constexpr (kOffsets) best[t] = offsets[0] + best[t];
    arg[t] = 0;
  }
  for (int64_t s = 1; s < T; ++s) {
    const scalar_t* row = rows + s * stride;
    for (int64_t t = 0; t < stride; ++t) {
      scalar_t cand = row[t];
      if constexpr (kOffsets) cand = offsets[s] + cand;
      const bool better = cand > best[t];
      best[t] = better ? cand : best[t];
      arg[t] = better ? s : arg[t];
    }
  }
}

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

// Select the K best of T sorted lists (the final choice over last tags): list s holds lists[s * K + r] (descending in r) and
// each of its entries is offset by offsets[s * offset_stride]. Writes the chosen values and
// codes (s * K + r); slots with nothing left get -inf. `heads` (T) and `head_values` (T) are
// scratch: head_values[s] is the next candidate of list s, so a round is one argmax over T
// values (branch-free, the first maximum wins) and one refill of the list it took from.
template <typename scalar_t, typename code_t>
void merge_top_k(const scalar_t* lists, const scalar_t* offsets, int64_t offset_stride, int64_t T,
                 int64_t K, scalar_t* values, code_t* codes, int64_t* heads, scalar_t* head_values) {
  for (int64_t s = 0; s < T; ++s) {
    heads[s] = 0;
    head_values[s] = lists[s * K] + offsets[s * offset_stride];
  }
  for (int64_t out = 0; out < K; ++out) {
    scalar_t best = head_values[0];
    int64_t best_s = 0;
    for (int64_t s = 1; s < T; ++s) {
      const bool better = head_values[s] > best;  // strict: smaller s wins a tie
      best = better ? head_values[s] : best;
      best_s = better ? s : best_s;
    }
    if (best == neg_inf<scalar_t>()) {  // only -inf left: these slots hold no sequence
      std::fill(values + out, values + K, neg_inf<scalar_t>());
      return;
    }
    values[out] = best;
    const int64_t rank = heads[best_s]++;
    codes[out] = static_cast<code_t>(best_s * K + rank);
    head_values[best_s] = rank + 1 < K ? lists[best_s * K + rank + 1] + offsets[best_s * offset_stride]
                                       : neg_inf<scalar_t>();
  }
}

// One k-best step, position i-1 -> i: for every tag t, the K best of lists[s][r] + trans[s, t]
// over all predecessors s and ranks r, plus emit[t]. These are T merges of the same T sorted
// lists, run side by side: a round is one column_argmax over the lists' current heads (all
// tags at once, in lanes) instead of one serial argmax chain per t.
// Scratch: head_values [s][t] (next candidate of list s for tag t; T x stride, its padding
// -inf), heads [s][t] (T x T), best and best_s (stride).
template <typename scalar_t, typename bp_t>
void kbest_step(const scalar_t* __restrict__ lists, const PaddedTransitions<scalar_t>& trans,
                const scalar_t* __restrict__ emit, int64_t K, scalar_t* __restrict__ next,
                bp_t* __restrict__ backpointers, scalar_t* __restrict__ head_values,
                int32_t* __restrict__ heads, scalar_t* __restrict__ best,
                typename Lanes<scalar_t>::Index* __restrict__ best_s) {
  const int64_t T = trans.T, stride = trans.stride;
  for (int64_t s = 0; s < T; ++s) {
    const scalar_t* trans_row = &trans.rows[s * stride];
    for (int64_t t = 0; t < T; ++t) {
      head_values[s * stride + t] = lists[s * K] + trans_row[t];
      heads[s * T + t] = 0;
    }
  }
  for (int64_t r = 0; r < K; ++r) {
    column_argmax<scalar_t, false>(nullptr, head_values, stride, T, best, best_s);
    for (int64_t t = 0; t < T; ++t) {
      next[t * K + r] = best[t] + emit[t];
      if (best[t] == neg_inf<scalar_t>()) continue;  // no sequence left for this slot
      const int64_t s = best_s[t];
      const int64_t rank = heads[s * T + t]++;
      backpointers[t * K + r] = static_cast<bp_t>(s * K + rank);
      head_values[s * stride + t] =
          rank + 1 < K ? lists[s * K + rank + 1] + trans.rows[s * stride + t] : neg_inf<scalar_t>();
    }
  }
}

// k-best for one sentence of length n >= 1 with K lists per tag. Writes paths (K, L) rows and
// scores (K,) for the valid results; rows with no sequence are left as they are (-1 / -inf).
// `work` holds the scratch of kbest_step and merge_top_k.
template <typename scalar_t, typename bp_t>
struct KBestWork {
  std::vector<scalar_t> lists, lists_next, head_values, best, final_values;
  std::vector<int32_t> heads;
  std::vector<typename Lanes<scalar_t>::Index> best_s;
  std::vector<int64_t> final_heads;
  std::vector<bp_t> backpointers, final_codes;
  KBestWork(int64_t L, int64_t T, int64_t stride, int64_t K)
      : lists(T * K), lists_next(T * K), head_values(T * stride, neg_inf<scalar_t>()),
        best(stride), final_values(K), heads(T * T), best_s(stride), final_heads(T),
        backpointers(std::max<int64_t>(L, 1) * T * K), final_codes(K) {}
};

template <typename scalar_t, typename bp_t>
void kbest_sentence(const scalar_t* emit, const PaddedTransitions<scalar_t>& trans, const scalar_t* start,
                    const scalar_t* end, int64_t n, int64_t T, int64_t K, int64_t L,
                    KBestWork<scalar_t, bp_t>& w, int64_t* paths, scalar_t* scores) {
  scalar_t* lists = w.lists.data();
  scalar_t* lists_next = w.lists_next.data();
  // Position 0: one sequence per tag, in rank 0 of its list.
  for (int64_t t = 0; t < T; ++t) {
    lists[t * K] = start[t] + emit[t];
    std::fill(lists + t * K + 1, lists + (t + 1) * K, neg_inf<scalar_t>());
  }
  for (int64_t i = 1; i < n; ++i) {
    kbest_step(lists, trans, emit + i * T, K, lists_next, w.backpointers.data() + i * T * K,
               w.head_values.data(), w.heads.data(), w.best.data(), w.best_s.data());
    std::swap(lists, lists_next);
  }
  merge_top_k(lists, end, 1, T, K, w.final_values.data(), w.final_codes.data(),
              w.final_heads.data(), w.best.data());
  for (int64_t k = 0; k < K; ++k) {
    if (w.final_values[k] == neg_inf<scalar_t>()) break;  // fewer than K sequences exist
    scores[k] = w.final_values[k];
    int64_t tag = w.final_codes[k] / K, rank = w.final_codes[k] % K;
    for (int64_t i = n - 1; i >= 0; --i) {
      paths[k * L + i] = tag;
      if (i > 0) {
        const int64_t code = w.backpointers[(i * T + tag) * K + rank];
        tag = code / K;
        rank = code % K;
      }
    }
  }
}

// scores (B,), paths (B, L) int64 (-1 at padded positions and where no sequence is allowed).
std::tuple<at::Tensor, at::Tensor> viterbi_cpu(const at::Tensor& emissions_in,
                                               const at::Tensor& transitions_in,
                                               const at::Tensor& start_in, const at::Tensor& end_in,
                                               const at::Tensor& lengths_in) {
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  auto paths = at::full({B, L}, -1, lengths.options());
  auto scores = at::empty({B}, emissions.options());
  std::vector<char> bad(B, 0);
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_viterbi", [&] {
    const scalar_t* emit = emissions.data_ptr<scalar_t>();
    const scalar_t* trans = transitions.data_ptr<scalar_t>();
    const scalar_t* st = start.data_ptr<scalar_t>();
    const scalar_t* en = end.data_ptr<scalar_t>();
    const int64_t* len = lengths.data_ptr<int64_t>();
    int64_t* path = paths.data_ptr<int64_t>();
    scalar_t* score = scores.data_ptr<scalar_t>();
    dispatch_backpointer_type(T, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      // Several sentences per vector (viterbi_lanes.h) where that is faster: same results, bit
      // for bit. Otherwise (few sentences for the threads) one sentence at a time, tags in lanes.
      const LanePlan plan = plan_viterbi_lanes<scalar_t, bp_t>(len, B, L, T);
      if (plan.use_lanes) {
        viterbi_lanes<scalar_t, bp_t>(plan, emit, trans, st, en, len, B, L, T, path, score, bad);
        return;
      }
      const PaddedTransitions<scalar_t> padded_trans(trans, T);
      at::parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
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

// Number of tag sequences of length L, saturated at `cap`.
int64_t num_sequences_capped(int64_t T, int64_t L, int64_t cap) {
  int64_t count = 1;
  for (int64_t i = 0; i < L && count < cap; ++i) count = count > cap / T ? cap : count * T;
  return std::min(count, cap);
}

// scores (B, K), paths (B, K, L) int64: the K best distinct sequences per sentence, descending;
// rows beyond the number of allowed sequences hold -1 / -inf.
std::tuple<at::Tensor, at::Tensor> kbest_viterbi_cpu(const at::Tensor& emissions_in,
                                                     const at::Tensor& transitions_in,
                                                     const at::Tensor& start_in, const at::Tensor& end_in,
                                                     const at::Tensor& lengths_in, int64_t k) {
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  TORCH_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  if (k == 1) {  // the 1-best is Viterbi, with the same tie rule: use the cheaper kernel
    auto [best_scores, best_paths] = viterbi_cpu(emissions, transitions, start, end, lengths);
    return {best_scores.unsqueeze(1), best_paths.unsqueeze(1)};
  }
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  auto paths = at::full({B, k, L}, -1, lengths.options());
  auto scores = at::full({B, k}, -std::numeric_limits<double>::infinity(), emissions.options());
  // No sentence has more than T^L sequences, so lists longer than that only hold -inf.
  const int64_t K = num_sequences_capped(T, L, k);
  std::vector<char> bad(B, 0);
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_kbest_viterbi", [&] {
    const scalar_t* emit = emissions.data_ptr<scalar_t>();
    const scalar_t* trans = transitions.data_ptr<scalar_t>();
    const scalar_t* st = start.data_ptr<scalar_t>();
    const scalar_t* en = end.data_ptr<scalar_t>();
    const int64_t* len = lengths.data_ptr<int64_t>();
    int64_t* path = paths.data_ptr<int64_t>();
    scalar_t* score = scores.data_ptr<scalar_t>();
    // Several sentences per vector (kbest_lanes.h) where that is faster: same results, bit for
    // bit. Otherwise one sentence at a time, tags in lanes.
    const LanePlan plan = plan_kbest_lanes<scalar_t>(len, B, L, T, K);
    if (plan.use_lanes) {
      kbest_lanes<scalar_t>(plan, emit, trans, st, en, len, B, L, T, K, k, path, score, bad);
      return;
    }
    dispatch_backpointer_type(T * K, [&](auto bp_tag) {
      using bp_t = decltype(bp_tag);
      const PaddedTransitions<scalar_t> padded_trans(trans, T);
      at::parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
        KBestWork<scalar_t, bp_t> work(L, T, padded_trans.stride, K);
        for (int64_t b = b_begin; b < b_end; ++b) {
          const int64_t n = len[b];
          const scalar_t* emit_b = emit + b * L * T;
          if (has_nan_or_posinf(emit_b, n * T)) {
            bad[b] = 1;
            continue;
          }
          if (n == 0) {  // exactly one sequence, the empty one, of score 0
            score[b * k] = 0;
            continue;
          }
          kbest_sentence(emit_b, padded_trans, st, en, n, T, K, L, work, path + b * k * L, score + b * k);
        }
      });
    });
  });
  raise_if_bad_emissions(bad);
  return {scores, paths};
}

}  // namespace

TORCH_LIBRARY_IMPL(crfkit, CPU, m) {
  m.impl("viterbi", &viterbi_cpu);
  m.impl("kbest_viterbi", &kbest_viterbi_cpu);
}

}  // namespace cpu
}  // namespace crfkit
