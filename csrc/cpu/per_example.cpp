// CPU kernels for per-example transitions (per_example.h): transitions (B, Lt, T, T) with Lt = 1
// or L, start / end (B, T). Parallel over sentences, one sentence per task.
//
// Why plain kernels next to the fast ones: those build tables from the one shared (T, T) matrix
// (prob_space.h's scaled exponentials, viterbi_common.h's padded rows) and scan several sentences
// per SIMD vector, none of which pays with a matrix per sentence or per position. Here:
// - log Z, marginals and their gradients: the forward-backward in log space, in double (each
//   sentence's scores converted once), one position a (T, T) matrix of scores reduced by a
//   logsumexp over its rows or columns (fast_exp.h's exp: vectorised). The marginals and the
//   pairwise marginals are normalised per position, as log_partition.cpp does (they sum to one
//   exactly, and a near-certain tag gets exactly 1).
// - Viterbi, k-best and sequence_score: in scalar_t, with the 2-D kernels' accumulation order
//   (score_i = (score_{i-1} + trans_i[y_{i-1}, y_i]) + emit_i[y_i], then + end[y_{n-1}]) and tie
//   rule (strict >: the smaller predecessor wins, then the earlier rank; the smaller last tag;
//   viterbi.cpp, kbest.cpp), so that transitions expanded from one (T, T) matrix give the 2-D
//   kernels' results bit for bit.
// The conventions are the 2-D kernels': a length-0 sentence has log Z 0, marginals 0 and an all -1
// path of score 0; an all-forbidden one log Z -inf, zero marginals and gradients, path -1 and
// score -inf; padded positions are never read and get zeros (paths -1).

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "../kbest_merge.h"
#include "../tensor.h"
#include "fast_exp.h"
#include "isa.h"
#include "lanes.h"
#include "log_space.h"
#include "per_example.h"
#include "viterbi_common.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
namespace {

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

// Sentence b's scores in the dense arguments: emit (L, T), start / end (T,) and, for position
// i >= 1, the (T, T) matrix of its y_{i-1} -> y_i transitions.
template <typename scalar_t>
struct Sentence {
  const scalar_t* emit;
  const scalar_t* trans;  // (Lt, T, T)
  int64_t trans_step;     // 0 for Lt = 1, T * T for Lt = L
  const scalar_t* start;
  const scalar_t* end;
  int64_t n;
  const scalar_t* trans_at(int64_t i) const { return trans + i * trans_step; }
};

template <typename scalar_t>
struct Batch {
  int64_t B, L, T, Lt;
  const scalar_t *emit, *trans, *start, *end;
  const int64_t* len;
  explicit Batch(const CrfArgs& a)
      : B(a.emissions.size(0)), L(a.emissions.size(1)), T(a.emissions.size(2)), Lt(a.transitions.size(1)),
        emit(data<scalar_t>(a.emissions)), trans(data<scalar_t>(a.transitions)), start(data<scalar_t>(a.start)),
        end(data<scalar_t>(a.end)), len(data<int64_t>(a.lengths)) {}
  Sentence<scalar_t> sentence(int64_t b) const {
    return {emit + b * L * T, trans + b * Lt * T * T, Lt == 1 ? 0 : T * T, start + b * T, end + b * T, len[b]};
  }
  // NaN / +inf within the sentence's length (raised after the parallel loop: isa.h).
  bool bad_emissions(int64_t b) const { return has_nan_or_posinf(emit + b * L * T, len[b] * T); }
};

// ---- forward-backward (log Z, marginals, pairwise marginals) --------------------------------------

// The exponentials below are all of x - max <= 0, taken in place over a whole row or (T, T)
// matrix: fast_exp.h's exp a lane vector at a time (lanes.h; std::exp is a library call per
// element, and the scalar exp_nonpositive does not vectorise on its own), then the tail.
void exp_in_place(double* x, int64_t n) {
  using Vector = Lanes<double>::Vector;
  constexpr int64_t kCount = Lanes<double>::kCount;
  int64_t k = 0;
  for (; k + kCount <= n; k += kCount) {
    store_lanes(x + k, exp_nonpositive_generic<Vector, Lanes<double>::Mask>(load_lanes(x + k)));
  }
  for (; k < n; ++k) x[k] = exp_nonpositive(x[k]);
}

// The shift of a logsumexp: the maximum, or 0 for a line of -inf (whose terms then are exp(-inf) =
// 0 and whose logsumexp is log 0 = -inf, never NaN).
inline double shift_of(double line_max) { return line_max == kNegInfD ? 0.0 : line_max; }

// out[r] = logsumexp_c(m[r * cols + c]) for the rows of the (rows, cols) matrix m, which is
// overwritten.
void row_logsumexp(double* __restrict__ m, int64_t rows, int64_t cols, double* __restrict__ out) {
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = shift_of(max_of(m + r * cols, cols));
    for (int64_t c = 0; c < cols; ++c) m[r * cols + c] -= out[r];
  }
  exp_in_place(m, rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    double total = 0;
    for (int64_t c = 0; c < cols; ++c) total += m[r * cols + c];
    out[r] += std::log(total);
  }
}

// out[t] = logsumexp_s(m[s * T + t]) for the T columns of the (T, T) matrix m, which is
// overwritten; top (T,) is scratch. The loops over t are inside (contiguous).
void column_logsumexp(double* __restrict__ m, int64_t T, double* __restrict__ out, double* __restrict__ top) {
  std::fill(top, top + T, kNegInfD);
  for (int64_t s = 0; s < T; ++s) {
    for (int64_t t = 0; t < T; ++t) top[t] = std::max(top[t], m[s * T + t]);
  }
  for (int64_t t = 0; t < T; ++t) top[t] = shift_of(top[t]);
  for (int64_t s = 0; s < T; ++s) {
    for (int64_t t = 0; t < T; ++t) m[s * T + t] -= top[t];
  }
  exp_in_place(m, T * T);
  std::fill(out, out + T, 0.0);
  for (int64_t s = 0; s < T; ++s) {
    for (int64_t t = 0; t < T; ++t) out[t] += m[s * T + t];
  }
  for (int64_t t = 0; t < T; ++t) out[t] = top[t] + std::log(out[t]);
}

// x[k] <- exp(x[k] - max) / sum_k exp(x[k] - max) in place; all zeros when every x[k] is -inf.
void softmax_in_place(double* __restrict__ x, int64_t n) {
  const double m = max_of(x, n);
  if (m == kNegInfD) {
    std::fill(x, x + n, 0.0);
    return;
  }
  for (int64_t k = 0; k < n; ++k) x[k] -= m;
  exp_in_place(x, n);
  double total = 0;
  for (int64_t k = 0; k < n; ++k) total += x[k];
  for (int64_t k = 0; k < n; ++k) x[k] /= total;
}

// One thread's space: a sentence of up to L positions in double, its forward rows, the backward's
// rows and a step's (T, T) scores.
struct FbWork {
  int64_t T, trans_step = 0;
  std::vector<double> emit, trans, start, end;   // (L, T), (L or 1, T, T), (T,), (T,)
  std::vector<double> alpha;                     // (L, T)
  std::vector<double> beta, beta_prev, mu, v;    // (T,)
  std::vector<double> step, pair, pair_sum;      // (T, T)
  std::vector<double> scratch;                   // (T,)
  FbWork(int64_t L, int64_t num_tags, int64_t Lt)
      : T(num_tags), emit(L * T), trans(std::max<int64_t>(Lt, 1) * T * T), start(T), end(T), alpha(L * T),
        beta(T), beta_prev(T), mu(T), v(T), step(T * T), pair(T * T), pair_sum(T * T), scratch(T) {}

  template <typename scalar_t>
  void load(const Sentence<scalar_t>& x) {
    std::copy(x.emit, x.emit + x.n * T, emit.begin());
    trans_step = x.trans_step;
    std::copy(x.trans, x.trans + (x.trans_step == 0 ? T * T : x.n * T * T), trans.begin());
    std::copy(x.start, x.start + T, start.begin());
    std::copy(x.end, x.end + T, end.begin());
  }
  const double* trans_at(int64_t i) const { return trans.data() + i * trans_step; }
};

// alpha_0 = start + emit_0, alpha_i[t] = logsumexp_s(alpha_{i-1}[s] + trans_i[s, t]) + emit_i[t];
// returns log Z = logsumexp_t(alpha_{n-1}[t] + end[t]). n >= 1.
double forward_sentence(FbWork& w, int64_t n) {
  const int64_t T = w.T;
  double* alpha = w.alpha.data();
  double* step = w.step.data();  // [s][t] = alpha_{i-1}[s] + trans_i[s, t]
  for (int64_t t = 0; t < T; ++t) alpha[t] = w.start[t] + w.emit[t];
  for (int64_t i = 1; i < n; ++i) {
    const double* prev = alpha + (i - 1) * T;
    const double* trans = w.trans_at(i);
    for (int64_t s = 0; s < T; ++s) {
      for (int64_t t = 0; t < T; ++t) step[s * T + t] = prev[s] + trans[s * T + t];
    }
    column_logsumexp(step, T, alpha + i * T, w.scratch.data());
    for (int64_t t = 0; t < T; ++t) alpha[i * T + t] += w.emit[i * T + t];
  }
  double* last = w.mu.data();
  for (int64_t t = 0; t < T; ++t) last[t] = alpha[(n - 1) * T + t] + w.end[t];
  double log_z;
  row_logsumexp(last, 1, T, &log_z);
  return log_z;
}

// Where the backward writes one sentence's outputs, each scaled by g (null: not wanted).
// pairs: (n, T, T) per position (row 0 left as it is) when pairs_per_position, else (T, T),
// the sum over positions.
template <typename scalar_t>
struct SentenceOutputs {
  scalar_t* marginals;  // (n, T)
  scalar_t* pairs;
  bool pairs_per_position;
  scalar_t* start;  // (T,): the marginals at position 0
  scalar_t* end;    // (T,): at position n - 1
};

// The backward recursion beta_{n-1} = end, beta_{i-1}[s] = logsumexp_t(trans_i[s, t] + v_i[t])
// with v_i = emit_i + beta_i, and from it, position by position from the last, the marginals
// softmax_t(alpha_i + beta_i) and the pairwise marginals softmax_{s,t}(alpha_{i-1}[s] +
// trans_i[s, t] + v_i[t]) (log Z finite, n >= 1; w holds forward_sentence's rows).
template <typename scalar_t>
void backward_sentence(FbWork& w, int64_t n, double g, const SentenceOutputs<scalar_t>& out) {
  const int64_t T = w.T;
  std::copy(w.end.begin(), w.end.end(), w.beta.begin());
  if (out.pairs != nullptr && !out.pairs_per_position) std::fill(w.pair_sum.begin(), w.pair_sum.end(), 0.0);
  for (int64_t i = n - 1; i >= 0; --i) {
    const double* alpha_i = w.alpha.data() + i * T;
    double* mu = w.mu.data();
    for (int64_t t = 0; t < T; ++t) mu[t] = alpha_i[t] + w.beta[t];
    softmax_in_place(mu, T);
    for (int64_t t = 0; t < T; ++t) {
      const auto scaled = static_cast<scalar_t>(g * mu[t]);
      if (out.marginals != nullptr) out.marginals[i * T + t] = scaled;
      if (out.start != nullptr && i == 0) out.start[t] = scaled;
      if (out.end != nullptr && i == n - 1) out.end[t] = scaled;
    }
    if (i == 0) break;

    const double* trans = w.trans_at(i);
    double* v = w.v.data();
    double* step = w.step.data();  // [s][t] = trans_i[s, t] + v_i[t]
    for (int64_t t = 0; t < T; ++t) v[t] = w.emit[i * T + t] + w.beta[t];
    for (int64_t s = 0; s < T; ++s) {
      for (int64_t t = 0; t < T; ++t) step[s * T + t] = trans[s * T + t] + v[t];
    }
    if (out.pairs != nullptr) {
      const double* alpha_prev = alpha_i - T;
      double* pair = w.pair.data();  // [s][t], as the transitions
      for (int64_t s = 0; s < T; ++s) {
        for (int64_t t = 0; t < T; ++t) pair[s * T + t] = alpha_prev[s] + step[s * T + t];
      }
      softmax_in_place(pair, T * T);
      if (out.pairs_per_position) {
        scalar_t* pairs_i = out.pairs + i * T * T;
        for (int64_t k = 0; k < T * T; ++k) pairs_i[k] = static_cast<scalar_t>(g * pair[k]);
      } else {
        for (int64_t k = 0; k < T * T; ++k) w.pair_sum[k] += pair[k];
      }
    }
    row_logsumexp(step, T, T, w.beta_prev.data());  // step is not needed after
    std::swap(w.beta, w.beta_prev);
  }
  if (out.pairs != nullptr && !out.pairs_per_position) {
    for (int64_t k = 0; k < T * T; ++k) out.pairs[k] = static_cast<scalar_t>(g * w.pair_sum[k]);
  }
}

// What forward_backward_batch writes (null: not wanted); the outputs are zero-filled before.
template <typename scalar_t>
struct BatchOutputs {
  scalar_t* log_z = nullptr;      // (B,)
  scalar_t* marginals = nullptr;  // (B, L, T)
  scalar_t* pairs = nullptr;      // (B, Lt, T, T) per position, else (B, T, T) summed
  bool pairs_per_position = false;
  scalar_t* start = nullptr;  // (B, T)
  scalar_t* end = nullptr;    // (B, T)
};

// The ops' gradients are for sum_b grad_log_z[b] log Z[b] (grad_log_z null: 1 for every b).
template <typename scalar_t>
void forward_backward_batch(const CrfArgs& a, const scalar_t* grad_log_z, const BatchOutputs<scalar_t>& out) {
  const Batch<scalar_t> x(a);
  const int64_t L = x.L, T = x.T;
  const bool wants_backward = out.marginals || out.pairs || out.start || out.end;
  const int64_t pairs_rows = out.pairs_per_position ? x.Lt : 1;
  std::vector<char> bad(x.B, 0);
  parallel_for(0, x.B, 1, [&](int64_t b_begin, int64_t b_end) {
    FbWork w(L, T, x.Lt);
    for (int64_t b = b_begin; b < b_end; ++b) {
      if (x.bad_emissions(b)) {
        bad[b] = 1;
        continue;
      }
      const Sentence<scalar_t> sentence = x.sentence(b);
      if (sentence.n == 0) {  // the empty sequence: log Z = 0, nothing to differentiate
        if (out.log_z != nullptr) out.log_z[b] = 0;
        continue;
      }
      w.load(sentence);
      const double log_z = forward_sentence(w, sentence.n);
      if (out.log_z != nullptr) out.log_z[b] = static_cast<scalar_t>(log_z);
      const double g = grad_log_z != nullptr ? static_cast<double>(grad_log_z[b]) : 1.0;
      // Every sequence forbidden (log Z = -inf) or no upstream gradient: the zeros stay.
      if (!wants_backward || log_z == kNegInfD || g == 0) continue;
      auto at = [](scalar_t* p, int64_t offset) { return p != nullptr ? p + offset : nullptr; };
      const SentenceOutputs<scalar_t> sentence_out{at(out.marginals, b * L * T), at(out.pairs, b * pairs_rows * T * T),
                                                   out.pairs_per_position, at(out.start, b * T), at(out.end, b * T)};
      backward_sentence(w, sentence.n, g, sentence_out);
    }
  });
  raise_if_bad_emissions(bad);
}

// ---- Viterbi and k-best --------------------------------------------------------------------------

// Viterbi for one sentence of length n >= 1: writes path[0 .. n) unless every sequence is
// forbidden, returns the best score. delta / next (T), backpointers (n, T) are scratch.
template <typename scalar_t>
scalar_t viterbi_sentence(const Sentence<scalar_t>& x, int64_t T, scalar_t* delta, scalar_t* next,
                          int64_t* backpointers, int64_t* path) {
  for (int64_t t = 0; t < T; ++t) delta[t] = x.start[t] + x.emit[t];
  for (int64_t i = 1; i < x.n; ++i) {
    const scalar_t* trans = x.trans_at(i);
    for (int64_t t = 0; t < T; ++t) {
      scalar_t best = delta[0] + trans[t];
      int64_t arg = 0;
      for (int64_t s = 1; s < T; ++s) {
        const scalar_t candidate = delta[s] + trans[s * T + t];
        if (candidate > best) {  // strict: the smaller predecessor wins a tie
          best = candidate;
          arg = s;
        }
      }
      next[t] = best + x.emit[i * T + t];
      backpointers[i * T + t] = arg;
    }
    std::copy(next, next + T, delta);
  }
  scalar_t best = delta[0] + x.end[0];
  int64_t tag = 0;
  for (int64_t t = 1; t < T; ++t) {
    if (delta[t] + x.end[t] > best) {
      best = delta[t] + x.end[t];
      tag = t;
    }
  }
  if (best == neg_inf<scalar_t>()) return best;  // every sequence forbidden: path stays -1
  for (int64_t i = x.n - 1; i >= 0; --i) {
    path[i] = tag;
    if (i > 0) tag = backpointers[i * T + tag];
  }
  return best;
}

// One thread's k-best space: per tag a list of K scores (T, K) for this position and the next,
// the backpointers (L, T, K) (code = s * K + rank of the predecessor), a merge's output and scratch.
template <typename scalar_t>
struct KBestWork {
  std::vector<scalar_t> lists, next, values, head_values;
  std::vector<int64_t> backpointers, codes, heads;
  KBestWork(int64_t L, int64_t T, int64_t K)
      : lists(T * K), next(T * K), values(K), head_values(T), backpointers(std::max<int64_t>(L, 1) * T * K),
        codes(K), heads(T) {}
};

// k-best for one sentence of length n >= 1 with lists of K: writes the rows r of paths (K, L) and
// scores (K,) that hold a sequence; the others are left as they are (-1 / -inf).
template <typename scalar_t>
void kbest_sentence(const Sentence<scalar_t>& x, int64_t T, int64_t K, int64_t L, KBestWork<scalar_t>& w,
                    int64_t* paths, scalar_t* scores) {
  scalar_t* lists = w.lists.data();
  scalar_t* next = w.next.data();
  for (int64_t t = 0; t < T; ++t) {  // position 0: one sequence per tag
    lists[t * K] = x.start[t] + x.emit[t];
    std::fill(lists + t * K + 1, lists + (t + 1) * K, neg_inf<scalar_t>());
  }
  for (int64_t i = 1; i < x.n; ++i) {
    const scalar_t* trans = x.trans_at(i);
    for (int64_t t = 0; t < T; ++t) {
      // (lists[s][r] + trans_i[s, t]) + emit_i[t]: -inf stays -inf (emissions are never +inf)
      merge_sorted_lists(lists, trans + t, T, T, K, w.values.data(), &w.backpointers[(i * T + t) * K],
                         w.heads.data(), w.head_values.data());
      for (int64_t r = 0; r < K; ++r) next[t * K + r] = w.values[r] + x.emit[i * T + t];
    }
    std::swap(lists, next);
  }
  merge_sorted_lists(lists, x.end, 1, T, K, w.values.data(), w.codes.data(), w.heads.data(), w.head_values.data());
  for (int64_t r = 0; r < K; ++r) {
    if (w.values[r] == neg_inf<scalar_t>()) break;  // fewer than K sequences exist
    scores[r] = w.values[r];
    int64_t code = w.codes[r];
    for (int64_t i = x.n - 1; i >= 0; --i) {
      paths[r * L + i] = code / K;
      if (i > 0) code = w.backpointers[i * T * K + code];
    }
  }
}

}  // namespace

CrfArgs checked_per_example_args(const Tensor& emissions_in, const Tensor& transitions_in, const Tensor& lengths_in,
                                 const Tensor& start_in, const Tensor& end_in) {
  CrfArgs a{as_contiguous(emissions_in), as_contiguous(transitions_in), as_contiguous(lengths_in),
            as_contiguous(start_in), as_contiguous(end_in)};
  check_per_example_inputs(a.emissions, a.transitions, a.lengths, a.start, a.end);
  check_lengths_cpu(a.lengths, a.emissions.size(1));
  check_parameters_finite_cpu(a.transitions, a.start, a.end);
  return a;
}

Tensor log_partition_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                 const Tensor& start, const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  auto log_z = empty({a.emissions.size(0)}, options_of(a.emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_log_partition_per_example", [&] {
    BatchOutputs<scalar_t> out;
    out.log_z = data<scalar_t>(log_z);
    forward_backward_batch<scalar_t>(a, nullptr, out);
  });
  return log_z;
}

Tensor marginals_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                             const Tensor& start, const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  auto marginals = zeros_like(a.emissions);
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_marginals_per_example", [&] {
    BatchOutputs<scalar_t> out;
    out.marginals = data<scalar_t>(marginals);
    forward_backward_batch<scalar_t>(a, nullptr, out);
  });
  return marginals;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_per_example(
    const Tensor& grad_log_z_in, const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
    const Tensor& start, const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  const Tensor grad_log_z = as_contiguous(grad_log_z_in);
  const int64_t B = a.emissions.size(0);
  check_argument_like(grad_log_z, "grad_log_z", "(batch,)", {B}, a.emissions, "emissions");
  auto grad_emissions = zeros_like(a.emissions);
  auto grad_transitions = zeros_like(a.transitions);
  auto grad_start = zeros_like(a.start);
  auto grad_end = zeros_like(a.end);
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_log_partition_backward_per_example", [&] {
    BatchOutputs<scalar_t> out;
    out.marginals = data<scalar_t>(grad_emissions);
    out.pairs = data<scalar_t>(grad_transitions);
    out.pairs_per_position = a.transitions.size(1) != 1;
    out.start = data<scalar_t>(grad_start);
    out.end = data<scalar_t>(grad_end);
    forward_backward_batch<scalar_t>(a, data<scalar_t>(grad_log_z), out);
  });
  return {grad_emissions, grad_transitions, grad_start, grad_end};
}

std::tuple<Tensor, Tensor, Tensor> log_partition_with_marginals_per_example(
    const Tensor& emissions, const Tensor& transitions, const Tensor& lengths, const Tensor& start,
    const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  auto log_z = empty({a.emissions.size(0)}, options_of(a.emissions));
  auto marginals = zeros_like(a.emissions);
  auto counts = zeros_like(a.transitions);
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_log_partition_with_marginals_per_example", [&] {
    BatchOutputs<scalar_t> out;
    out.log_z = data<scalar_t>(log_z);
    out.marginals = data<scalar_t>(marginals);
    out.pairs = data<scalar_t>(counts);
    out.pairs_per_position = a.transitions.size(1) != 1;
    forward_backward_batch<scalar_t>(a, nullptr, out);
  });
  return {log_z, marginals, counts};
}

// The 2-D op's arithmetic per sentence, nothing summed over the batch: grad_emissions =
// g[b] * marginals within the length, grad_transitions[b] = g[b] * counts[b], grad_start[b] /
// grad_end[b] = g[b] * the marginals at the first / last position (0 for a length-0 sentence).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_from_marginals_per_example(
    const Tensor& grad_log_z_in, const Tensor& marginals_in, const Tensor& counts_in, const Tensor& lengths_in) {
  const Tensor grad_log_z = as_contiguous(grad_log_z_in), marginals = as_contiguous(marginals_in),
               counts = as_contiguous(counts_in), lengths = as_contiguous(lengths_in);
  check_backward_from_marginals_arguments(grad_log_z, marginals, counts, lengths);
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2), Lt = counts.size(1);
  check_lengths_cpu(lengths, L);
  auto grad_emissions = zeros_like(marginals);
  auto grad_transitions = empty_as(counts);
  auto grad_start = zeros({B, T}, options_of(marginals));
  auto grad_end = zeros({B, T}, options_of(marginals));
  CRFKIT_DISPATCH_FLOATING_TYPES(marginals.scalar_type(), "crfkit_log_partition_backward_from_marginals_per_example",
                                 [&] {
    const scalar_t* g = data<scalar_t>(grad_log_z);
    const scalar_t* mu = data<scalar_t>(marginals);
    const scalar_t* cnt = data<scalar_t>(counts);
    const int64_t* len = data<int64_t>(lengths);
    scalar_t* out_emit = data<scalar_t>(grad_emissions);
    scalar_t* out_trans = data<scalar_t>(grad_transitions);
    scalar_t* out_start = data<scalar_t>(grad_start);
    scalar_t* out_end = data<scalar_t>(grad_end);
    const int64_t pairs = Lt * T * T;
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t n = len[b];
        // Positions past the length stay exactly 0 (also for an infinite g).
        for (int64_t k = 0; k < n * T; ++k) out_emit[b * L * T + k] = g[b] * mu[b * L * T + k];
        for (int64_t k = 0; k < pairs; ++k) out_trans[b * pairs + k] = g[b] * cnt[b * pairs + k];
        if (n == 0) continue;
        const scalar_t* first = mu + b * L * T;
        const scalar_t* last = first + (n - 1) * T;
        for (int64_t t = 0; t < T; ++t) {
          out_start[b * T + t] = g[b] * first[t];
          out_end[b * T + t] = g[b] * last[t];
        }
      }
    });
  });
  return {grad_emissions, grad_transitions, grad_start, grad_end};
}

Tensor expected_transition_counts_per_example(const Tensor& emissions, const Tensor& transitions,
                                              const Tensor& lengths, const Tensor& start, const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  const int64_t B = a.emissions.size(0), T = a.emissions.size(2);
  auto counts = zeros({B, T, T}, options_of(a.emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_expected_transition_counts_per_example", [&] {
    BatchOutputs<scalar_t> out;
    out.pairs = data<scalar_t>(counts);  // summed over positions, also for Lt = L
    forward_backward_batch<scalar_t>(a, nullptr, out);
  });
  return counts;
}

std::tuple<Tensor, Tensor> viterbi_per_example(const Tensor& emissions, const Tensor& transitions,
                                               const Tensor& lengths, const Tensor& start, const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  auto paths = full({B, L}, -1, options_of(a.lengths));
  auto scores = empty({B}, options_of(a.emissions));
  std::vector<char> bad(B, 0);
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_viterbi_per_example", [&] {
    const Batch<scalar_t> x(a);
    int64_t* path = data<int64_t>(paths);
    scalar_t* score = data<scalar_t>(scores);
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      std::vector<scalar_t> delta(T), next(T);
      std::vector<int64_t> backpointers(std::max<int64_t>(L, 1) * T);
      for (int64_t b = b_begin; b < b_end; ++b) {
        if (x.bad_emissions(b)) {
          bad[b] = 1;
          continue;
        }
        const Sentence<scalar_t> sentence = x.sentence(b);
        score[b] = sentence.n == 0 ? scalar_t(0)  // the empty sequence
                                   : viterbi_sentence(sentence, T, delta.data(), next.data(), backpointers.data(),
                                                      path + b * L);
      }
    });
  });
  raise_if_bad_emissions(bad);
  return {scores, paths};
}

std::tuple<Tensor, Tensor> kbest_viterbi_per_example(const Tensor& emissions, const Tensor& transitions,
                                                     int64_t k, const Tensor& lengths, const Tensor& start,
                                                     const Tensor& end) {
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  CRFKIT_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  if (k == 1) {  // the 1-best is Viterbi, with the same tie rule (as kbest_viterbi_cpu)
    auto [best_scores, best_paths] = viterbi_per_example(a.emissions, a.transitions, a.lengths, a.start, a.end);
    return {torch::stable::unsqueeze(best_scores, 1), torch::stable::unsqueeze(best_paths, 1)};
  }
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  auto paths = full({B, k, L}, -1, options_of(a.lengths));
  auto scores = full({B, k}, -std::numeric_limits<double>::infinity(), options_of(a.emissions));
  const int64_t K = num_sequences_capped(T, L, k);  // longer lists would only hold -inf
  std::vector<char> bad(B, 0);
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_kbest_viterbi_per_example", [&] {
    const Batch<scalar_t> x(a);
    int64_t* path = data<int64_t>(paths);
    scalar_t* score = data<scalar_t>(scores);
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      KBestWork<scalar_t> work(L, T, K);
      for (int64_t b = b_begin; b < b_end; ++b) {
        if (x.bad_emissions(b)) {
          bad[b] = 1;
          continue;
        }
        const Sentence<scalar_t> sentence = x.sentence(b);
        if (sentence.n == 0) {  // exactly one sequence, the empty one, of score 0
          score[b * k] = 0;
          continue;
        }
        kbest_sentence(sentence, T, K, L, work, path + b * k * L, score + b * k);
      }
    });
  });
  raise_if_bad_emissions(bad);
  return {scores, paths};
}

Tensor sequence_score_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& tags_in,
                                  const Tensor& lengths, const Tensor& start, const Tensor& end) {
  const Tensor tags = as_contiguous(tags_in);
  const CrfArgs a = checked_per_example_args(emissions, transitions, lengths, start, end);
  check_tags(tags, a.emissions);
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const int64_t N = tags.size(1);
  const int64_t* len = data<int64_t>(a.lengths);
  const int64_t* tag = data<int64_t>(tags);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < N; ++j) check_tag_row(tag + (b * N + j) * L, len[b], T, b, j);
  }
  auto scores = empty({B, N}, options_of(a.emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_sequence_score_per_example", [&] {
    const Batch<scalar_t> x(a);
    std::vector<char> bad(B, 0);
    for (int64_t b = 0; b < B; ++b) bad[b] = x.bad_emissions(b);
    raise_if_bad_emissions(bad);
    scalar_t* out = data<scalar_t>(scores);
    parallel_for(0, B * N, 64, [&](int64_t row_begin, int64_t row_end) {
      for (int64_t row = row_begin; row < row_end; ++row) {
        const Sentence<scalar_t> s = x.sentence(row / N);
        const int64_t* y = tag + row * L;
        if (s.n == 0) {
          out[row] = 0;
          continue;
        }
        scalar_t score = s.start[y[0]] + s.emit[y[0]];
        for (int64_t i = 1; i < s.n; ++i) score = (score + s.trans_at(i)[y[i - 1] * T + y[i]]) + s.emit[i * T + y[i]];
        out[row] = score + s.end[y[s.n - 1]];
      }
    });
  });
  return scores;
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
