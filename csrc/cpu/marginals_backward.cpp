// CPU kernels of marginals_backward: the vector-Jacobian product of the marginals with an
// upstream gradient V (B, L, T), for emissions, transitions, start and end; and of
// expected_transition_counts_backward, the same for the expected transition counts with an
// upstream gradient W (B, T, T) (see the end of this comment).
//
// The marginals are mu = d log Z / d emissions, so the product is a Hessian-vector product of
// log Z in the direction v = (V, 0, 0, 0) (the direction lives in emissions space, the result in
// the space of every parameter). H is symmetric, so H v is the forward-mode (tangent) derivative
// d/de of ALL the first derivatives of log Z at theta + e v: the tangents of the marginals
// (-> the emissions' gradient), of the expected transition counts summed over the batch
// (-> transitions), of the first and of the last marginals (-> start, end). Per sentence of
// length n >= 1, in log space (a, b are the tangents of alpha, beta):
//
//   alpha_0 = start + emit_0                      a_0 = V_0
//   alpha_i(j) = lse_s(alpha_{i-1}(s) + trans(s, j)) + emit_i(j)
//   a_i(j) = sum_s P_i(s|j) a_{i-1}(s) + V_i(j),  P_i(s|j) = softmax_s(alpha_{i-1}(s) + trans(s, j))
//   beta_{n-1} = end                              b_{n-1} = 0
//   beta_i(s) = lse_j(trans(s, j) + emit_{i+1}(j) + beta_{i+1}(j))
//   b_i(s) = sum_j Q_i(j|s) (V_{i+1}(j) + b_{i+1}(j)),  Q_i(j|s) the softmax over j of the same
//   mu_i = softmax_j(alpha_i + beta_i)            (each row sums to 1: Z = sum_j exp(alpha_i + beta_i))
//   z_i = sum_j mu_i(j) (a_i(j) + b_i(j))         (= d log Z / de, the same for every i)
//   dmu_i(j) = mu_i(j) (a_i(j) + b_i(j) - z_i)
//   xi_i(s, j) = P_i(s|j) mu_i(j)                 (pairwise marginal of positions i-1, i)
//   dxi_i(s, j) = P_i(s|j) (mu_i(j) (a_{i-1}(s) - sum_r P_i(r|j) a_{i-1}(r)) + dmu_i(j))
//
// grad_emissions[b, i] = dmu_i (0 at padded positions), grad_transitions = sum over b and i >= 1
// of dxi_i, grad_start = sum_b dmu_0, grad_end = sum_b dmu_{n-1}. (z_i and the centred forms of
// dmu and dxi are the plain formulas with the mean tangent subtracted per row / column: equal in
// exact arithmetic, and the rows of dmu sum to 0 to rounding.)
//
// -inf scores: a forbidden tag, transition, first or last tag gives weights exactly 0 (every
// softmax is taken after subtracting a finite maximum, and a line whose terms are all -inf is
// skipped); the tangents a, b are finite everywhere (V plus weighted means of finite values), so
// their products with those zero weights are 0, never NaN. A sentence whose sequences are all
// forbidden (log Z = -inf) and a length-0 sentence get zero gradients. Padded positions are never
// read, in emissions or in V.
//
// The counts are the derivatives of log Z in the transitions, so their product with W is the same
// tangent in the direction of the transitions, W_b for sentence b (and V = 0): every term s of a
// forward line j moves by a_{i-1}(s) + W(s, j) instead of a_{i-1}(s), every term j of a backward
// line s by V_{i+1}(j) + b_{i+1}(j) + W(s, j), and so does the term s of dxi_i(s, j) (whose mean_i(j)
// is the moved line's). tangent_backward computes either or both directions.
//
// Everything is computed in double (float32 inputs are widened per sentence): the tangents are
// differences of means, where float32 would lose digits. The log-space steps use log_space.h's
// factored exponentials (ScaledTransitions: T exponentials and two T x T products per step, the
// line recomputed exactly in log space where the factored sum underflows); the forward keeps its
// rows (alpha, a, the means and the column sums, O(L T) per thread), the backward keeps one row.
// Parallel over sentences; the batch sums are per-sentence partial sums reduced in a fixed order,
// so the result does not depend on the number of threads. The CUDA kernel
// (csrc/cuda/marginals_backward.cu) computes the same formulas with exact lines. The op has no
// derivative of its own: differentiating its outputs raises (crfkit/backends/compiled.py).


#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../tensor.h"
#include "../checks.h"
#include "isa.h"
#include "log_space.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
namespace {

// sx = sum_m e[m] x[m] and sy = sum_m e[m] y[m], in one pass over e. The sums may be reassociated
// (omp simd) so that they vectorise; the order is fixed for a build, so results do not vary from
// run to run or with the number of threads.
inline void dot2(const double* e, const double* x, const double* y, int64_t n, double& sx, double& sy) {
  double a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
  for (int64_t m = 0; m < n; ++m) {
    a += e[m] * x[m];
    b += e[m] * y[m];
  }
  sx = a;
  sy = b;
}

// sum_m e[m] x[m] y[m].
inline double dot3(const double* e, const double* x, const double* y, int64_t n) {
  double a = 0;
#pragma omp simd reduction(+ : a)
  for (int64_t m = 0; m < n; ++m) a += e[m] * x[m] * y[m];
  return a;
}

// The exact log-space line: w[m] = softmax_m(x[m] + line[m * stride]) (summing to 1) and the log
// of the normaliser, lse_m(x[m] + line[m * stride]). Returns -inf, w unspecified, when every term
// is -inf.
inline double exact_line(const double* x, const double* line, int64_t stride, int64_t T, double* w) {
  double m_max = neg_inf<double>();
  for (int64_t m = 0; m < T; ++m) m_max = std::max(m_max, x[m] + line[m * stride]);
  if (m_max == neg_inf<double>()) return m_max;
  double sum = 0;
  for (int64_t m = 0; m < T; ++m) sum += (w[m] = std::exp(x[m] + line[m * stride] - m_max));
  const double inv = 1.0 / sum;
  for (int64_t m = 0; m < T; ++m) w[m] *= inv;
  return m_max + std::log(sum);
}

// One step of a recursion and of its tangent, for every line k:
//   out[k] = lse_m(x[m] + trans(m, k)) (by_column, forward) or lse_m(trans(k, m) + x[m]) (by row,
//   backward), and mean[k] = sum_m w_k[m] dx[m], w_k the line's softmax weights.
// As log_space.h's forward_step: exp(x[m] + trans) = exp(x_max + line_max) p[m] scaled[k][m] with
// p = exp(x - x_max), so a line costs two dot products (its normaliser and its weighted tangent);
// where the normaliser falls below trusted_sum_min (underflow) the line is recomputed exactly.
// A line whose terms are all -inf gets out = -inf and mean = 0. sums[k] (when not null) receives
// the line's factored normaliser, or 0 where the exact path ran (read by the pairwise pass).
// p, pd, w are scratch of size T; on return p = exp(x - x_max) and pd = p * dx.
// dir (T, T) or null: a tangent of the transitions, line k's entries in row k (dir[k * T + m] is
// the direction of the term m of line k); with it mean[k] also gets sum_m w_k[m] dir[k * T + m].
inline void tangent_step(const double* x, const double* dx, const double* trans,
                         const ScaledTransitions<double>& tables, bool by_column, double* out, double* mean,
                         double* sums, double* p, double* pd, double* w, const double* dir = nullptr) {
  const int64_t T = tables.T;
  const double x_max = max_of(x, T);
  if (x_max == neg_inf<double>()) {
    std::fill(out, out + T, neg_inf<double>());
    std::fill(mean, mean + T, 0.0);
    if (sums != nullptr) std::fill(sums, sums + T, 0.0);
    return;
  }
  for (int64_t m = 0; m < T; ++m) {
    p[m] = std::exp(x[m] - x_max);
    pd[m] = p[m] == 0 ? 0.0 : p[m] * dx[m];
  }
  for (int64_t k = 0; k < T; ++k) {
    double sum = 0, weighted = 0;
    const double l_max = tables.line_max[k];
    if (l_max != neg_inf<double>()) dot2(&tables.scaled[k * T], p, pd, T, sum, weighted);
    if (sums != nullptr) sums[k] = sum >= trusted_sum_min<double>() ? sum : 0.0;
    if (sum >= trusted_sum_min<double>()) {
      if (dir != nullptr) weighted += dot3(&tables.scaled[k * T], p, dir + k * T, T);
      out[k] = x_max + l_max + std::log(sum);
      mean[k] = weighted / sum;
      continue;
    }
    out[k] = l_max == neg_inf<double>()
                 ? neg_inf<double>()
                 : exact_line(x, by_column ? trans + k : trans + k * T, by_column ? T : 1, T, w);
    mean[k] = out[k] == neg_inf<double>() ? 0.0 : dot(w, dx, T) + (dir != nullptr ? dot(w, dir + k * T, T) : 0.0);
  }
}

// Per-thread working memory, allocated once per chunk of sentences.
struct Work {
  // (L, T): the sentence in double, alpha, its tangent a, the forward's weighted means
  // sum_s P_i(s|j) a_{i-1}(s) and its factored column sums (0 where it ran exactly).
  std::vector<double> emit, grad, alpha, a, mean, col_sum;
  std::vector<double> beta, b, beta_prev, b_prev, v, dv, mu, dmu, p, pd, w;  // (T,)
  std::vector<double> pair;  // (T, T) as [to][from]: the sentence's transitions gradient, transposed
  std::vector<double> dir, dir_t;  // (T, T): the transitions' tangent W [from][to] and transposed

  Work(int64_t L, int64_t T)
      : emit(L * T), grad(L * T), alpha(L * T), a(L * T), mean(L * T), col_sum(L * T), beta(T), b(T),
        beta_prev(T), b_prev(T), v(T), dv(T), mu(T), dmu(T), p(T), pd(T), w(T), pair(T * T), dir(T * T),
        dir_t(T * T) {}
};

// The gradients of one sentence of length n >= 1 (emit, grad: its n rows in double; with_dir:
// the direction also has the transitions' tangent work.dir, and work.dir_t its transpose):
// grad_emit (n, T) in scalar_t, and the sentence's shares of the transitions' (T, T), start's
// and end's (T,) gradients, written to trans_out / start_out / end_out (double, zeroed).
template <typename scalar_t>
void sentence_backward(int64_t n, int64_t T, const double* trans, const double* start, const double* end,
                       const ScaledTransitions<double>& by_col, const ScaledTransitions<double>& by_row,
                       Work& work, bool with_dir, scalar_t* grad_emit, double* trans_out, double* start_out,
                       double* end_out) {
  const double* emit = work.emit.data();
  const double* V = work.grad.data();
  const double* dir = with_dir ? work.dir.data() : nullptr;      // line s of a backward step: W(s, .)
  const double* dir_t = with_dir ? work.dir_t.data() : nullptr;  // line j of a forward step: W(., j)
  double *alpha = work.alpha.data(), *a = work.a.data(), *mean = work.mean.data(), *col_sum = work.col_sum.data();
  double *p = work.p.data(), *pd = work.pd.data(), *w = work.w.data(), *mu = work.mu.data(), *dmu = work.dmu.data();

  // Forward: alpha and its tangent a, every row kept.
  for (int64_t t = 0; t < T; ++t) {
    alpha[t] = start[t] + emit[t];
    a[t] = V[t];
  }
  for (int64_t i = 1; i < n; ++i) {
    double* alpha_i = alpha + i * T;
    double* a_i = a + i * T;
    tangent_step(alpha + (i - 1) * T, a + (i - 1) * T, trans, by_col, /*by_column=*/true, alpha_i, mean + i * T,
                 col_sum + i * T, p, pd, w, dir_t);
    for (int64_t t = 0; t < T; ++t) {
      alpha_i[t] += emit[i * T + t];
      a_i[t] = mean[i * T + t] + V[i * T + t];
    }
  }
  {  // every sequence forbidden (log Z = -inf): all gradients 0
    double m = neg_inf<double>();
    for (int64_t t = 0; t < T; ++t) m = std::max(m, alpha[(n - 1) * T + t] + end[t]);
    if (m == neg_inf<double>()) return;
  }

  // Backward: beta and its tangent b, one row at a time, with the outputs of position i.
  double* pair = work.pair.data();
  std::fill(pair, pair + T * T, 0.0);
  double *beta = work.beta.data(), *b = work.b.data();
  std::copy(end, end + T, beta);
  std::fill(b, b + T, 0.0);
  for (int64_t i = n - 1; i >= 0; --i) {
    const double* alpha_i = alpha + i * T;
    const double* a_i = a + i * T;
    // mu_i = softmax(alpha_i + beta_i); its maximum is finite when log Z is.
    double u_max = neg_inf<double>();
    for (int64_t t = 0; t < T; ++t) u_max = std::max(u_max, mu[t] = alpha_i[t] + beta[t]);
    double total = 0;
    for (int64_t t = 0; t < T; ++t) total += (mu[t] = std::exp(mu[t] - u_max));
    double z = 0;
    for (int64_t t = 0; t < T; ++t) {
      mu[t] /= total;
      z += mu[t] == 0 ? 0.0 : mu[t] * (a_i[t] + b[t]);
    }
    for (int64_t t = 0; t < T; ++t) {
      dmu[t] = mu[t] == 0 ? 0.0 : mu[t] * (a_i[t] + b[t] - z);
      grad_emit[i * T + t] = static_cast<scalar_t>(dmu[t]);
    }
    if (i == 0) std::copy(dmu, dmu + T, start_out);
    if (i == n - 1) std::copy(dmu, dmu + T, end_out);
    if (i == 0) break;

    // Pairwise tangents of positions (i-1, i): column j gets
    // P_i(s|j) (mu_i(j) (a_{i-1}(s) - mean_i(j)) + dmu_i(j)). With the forward's factored weights
    // P_i(s|j) = p[s] scaled[j][s] / col_sum_i(j) that is scaled[j][s] (c1 p[s] a_{i-1}(s) + c0 p[s]):
    // a T x T update without reductions.
    const double* alpha_prev = alpha + (i - 1) * T;
    const double* a_prev = a + (i - 1) * T;
    const double x_max = max_of(alpha_prev, T);  // finite: position i-1 is reachable
    for (int64_t s = 0; s < T; ++s) {
      p[s] = std::exp(alpha_prev[s] - x_max);  // as the forward step computed them
      pd[s] = p[s] == 0 ? 0.0 : p[s] * a_prev[s];
    }
    for (int64_t j = 0; j < T; ++j) {
      if (mu[j] == 0) continue;  // tag j unreachable at i: xi and its tangent are 0
      const double mean_j = mean[i * T + j];
      double* pair_j = pair + j * T;
      const double sum = col_sum[i * T + j];
      // With a transitions' tangent the term s of column j moves by a_{i-1}(s) + W(s, j).
      const double* dir_j = with_dir ? dir_t + j * T : nullptr;
      if (sum > 0) {
        const double c1 = mu[j] / sum, c0 = (dmu[j] - mu[j] * mean_j) / sum;
        const double* scaled = &by_col.scaled[j * T];
        if (with_dir) {
#pragma omp simd
          for (int64_t s = 0; s < T; ++s) pair_j[s] += scaled[s] * (c1 * (pd[s] + p[s] * dir_j[s]) + c0 * p[s]);
        } else {
#pragma omp simd
          for (int64_t s = 0; s < T; ++s) pair_j[s] += scaled[s] * (c1 * pd[s] + c0 * p[s]);
        }
      } else if (exact_line(alpha_prev, trans + j, T, T, w) != neg_inf<double>()) {
        for (int64_t s = 0; s < T; ++s) {
          const double moved = a_prev[s] + (with_dir ? dir_j[s] : 0.0);
          if (w[s] != 0) pair_j[s] += w[s] * (mu[j] * (moved - mean_j) + dmu[j]);
        }
      }
    }

    // beta_{i-1}, b_{i-1} from v = emit_i + beta_i and dv = V_i + b_i.
    double *v = work.v.data(), *dv = work.dv.data();
    for (int64_t t = 0; t < T; ++t) {
      v[t] = emit[i * T + t] + beta[t];
      dv[t] = V[i * T + t] + b[t];
    }
    tangent_step(v, dv, trans, by_row, /*by_column=*/false, work.beta_prev.data(), work.b_prev.data(), nullptr, p,
                 pd, w, dir);
    std::swap(work.beta, work.beta_prev);
    std::swap(work.b, work.b_prev);
    beta = work.beta.data();
    b = work.b.data();
  }
  for (int64_t s = 0; s < T; ++s) {
    for (int64_t j = 0; j < T; ++j) trans_out[s * T + j] = pair[j * T + s];
  }
}

}  // namespace

namespace {

// The vector-Jacobian product of the marginals with grad_marginals (B, L, T) and / or of the
// expected transition counts with grad_counts (B, T, T) (either may be undefined: a zero
// direction there), for CRF arguments checked by checked_cpu_args: the Hessian-vector product of
// log Z in the direction (grad_marginals, per-sentence grad_counts, 0, 0).
std::tuple<Tensor, Tensor, Tensor, Tensor> tangent_backward(
    const Tensor& grad_marginals, const Tensor& grad_counts, const Tensor& emissions,
    const Tensor& transitions, const Tensor& lengths, const Tensor& start, const Tensor& end) {
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  const auto as_double = [](const Tensor& x) { return as_contiguous(to_dtype(x, kDouble)); };
  const Tensor trans_d = as_double(transitions), start_d = as_double(start), end_d = as_double(end);
  auto grad_emissions = empty_as(emissions);  // every row written by its sentence's thread
  // Per-sentence partial sums in double, reduced in a fixed order afterwards: deterministic.
  auto trans_acc = zeros({B, T, T}, options_of(emissions).dtype(kDouble));
  auto start_acc = zeros({B, T}, options_of(emissions).dtype(kDouble));
  auto end_acc = zeros({B, T}, options_of(emissions).dtype(kDouble));
  const int64_t* len = lengths.mutable_data_ptr<int64_t>();
  std::vector<char> bad(B, 0);
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_marginals_backward", [&] {
    const scalar_t* emit = emissions.mutable_data_ptr<scalar_t>();
    const scalar_t* grad = grad_marginals.defined() ? grad_marginals.mutable_data_ptr<scalar_t>() : nullptr;
    const scalar_t* grad_w = grad_counts.defined() ? grad_counts.mutable_data_ptr<scalar_t>() : nullptr;
    scalar_t* out = grad_emissions.mutable_data_ptr<scalar_t>();
    const double* trans = trans_d.mutable_data_ptr<double>();
    const double* st = start_d.mutable_data_ptr<double>();
    const double* en = end_d.mutable_data_ptr<double>();
    double* trans_sums = trans_acc.mutable_data_ptr<double>();
    double* start_sums = start_acc.mutable_data_ptr<double>();
    double* end_sums = end_acc.mutable_data_ptr<double>();
    const ScaledTransitions<double> by_col(trans, T, /*by_column=*/true);
    const ScaledTransitions<double> by_row(trans, T, /*by_column=*/false);
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      Work work(L, T);
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t n = len[b];
        std::fill(out + b * L * T, out + (b + 1) * L * T, scalar_t(0));
        if (has_nan_or_posinf(emit + b * L * T, n * T)) {
          bad[b] = 1;
          continue;
        }
        if (n == 0) continue;  // the empty sequence: nothing to differentiate
        std::copy(emit + b * L * T, emit + b * L * T + n * T, work.emit.begin());
        if (grad != nullptr) {
          std::copy(grad + b * L * T, grad + b * L * T + n * T, work.grad.begin());
        } else {
          std::fill(work.grad.begin(), work.grad.begin() + n * T, 0.0);
        }
        if (grad_w != nullptr) {
          for (int64_t s = 0; s < T; ++s) {
            for (int64_t j = 0; j < T; ++j) {
              work.dir[s * T + j] = work.dir_t[j * T + s] = static_cast<double>(grad_w[(b * T + s) * T + j]);
            }
          }
        }
        sentence_backward<scalar_t>(n, T, trans, st, en, by_col, by_row, work, grad_w != nullptr, out + b * L * T,
                                    trans_sums + b * T * T, start_sums + b * T, end_sums + b * T);
      }
    });
  });
  raise_if_bad_emissions(bad);
  const auto dtype = emissions.scalar_type();
  return {grad_emissions, to_dtype(sum_first_dim(trans_acc), dtype), to_dtype(sum_first_dim(start_acc), dtype), to_dtype(sum_first_dim(end_acc), dtype)};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> marginals_backward_cpu(
    const Tensor& grad_marginals_in, const Tensor& emissions_in, const Tensor& transitions_in,
    const Tensor& lengths_in, const Tensor& start_in, const Tensor& end_in) {
  check_not_per_example(transitions_in, "transitions",
                        "marginals_backward (differentiate the marginals through crfkit.reference)");
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  const Tensor grad_marginals = as_contiguous(grad_marginals_in);
  check_argument_like(grad_marginals, "grad_marginals", "(batch, seq_len, num_tags)", emissions.sizes(), emissions,
                      "emissions");
  return tangent_backward(grad_marginals, Tensor(), emissions, transitions, lengths, start, end);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> expected_transition_counts_backward_cpu(
    const Tensor& grad_counts_in, const Tensor& emissions_in, const Tensor& transitions_in,
    const Tensor& lengths_in, const Tensor& start_in, const Tensor& end_in) {
  check_not_per_example(transitions_in, "transitions",
                        "expected_transition_counts_backward (differentiate the counts through crfkit.reference)");
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  const Tensor grad_counts = as_contiguous(grad_counts_in);
  const int64_t B = emissions.size(0), T = emissions.size(2);
  check_argument_like(grad_counts, "grad_counts", "(batch, num_tags, num_tags)", {B, T, T}, emissions, "emissions");
  return tangent_backward(Tensor(), grad_counts, emissions, transitions, lengths, start, end);
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
