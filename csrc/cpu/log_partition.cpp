// CPU kernels: log partition (forward algorithm), marginals and the analytic backward of log Z
// (forward-backward). Parallel over sentences. From 8 sentences on (T <= 64) they are scanned 8
// at a time, one per SIMD lane (prob_lanes.h); otherwise, and for any sentence a lane group
// cannot finish, one sentence per scan (prob_space.h, then log_space.h).
//
// Layout: emissions (B, L, T) contiguous, transitions (T, T) as [from, to], start / end (T,),
// lengths (B,) int64. Sentence b uses positions 0 .. lengths[b]-1; padded positions are never
// read and get zero marginals / gradients. A length-0 sentence has exactly one (empty) tag
// sequence of score 0: log Z = 0 and no marginals.


#include <memory>

#include "../tensor.h"
#include "../checks.h"
#include "isa.h"
#include "log_space.h"
#include "per_example.h"
#include "prob_lanes.h"
#include "prob_space.h"
#include "recycled_memory.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
namespace {

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

// Forward scan of one sentence of length n >= 1. Writes the normalised alpha rows
// (alpha[i][t] = alpha_hat[i * T + t] + offset[i]) when `keep_rows`, else only two rolling rows
// in alpha_hat[0 .. 2T). Returns log Z in double.
template <typename scalar_t>
double forward_scan(const scalar_t* emit, const scalar_t* trans, const scalar_t* start,
                    const scalar_t* end, const ScaledTransitions<scalar_t>& by_col, int64_t n,
                    int64_t T, bool keep_rows, scalar_t* alpha_hat, double* offset,
                    scalar_t* scratch) {
  scalar_t* row = alpha_hat;
  for (int64_t t = 0; t < T; ++t) row[t] = start[t] + emit[t];
  double off = normalise(row, T);
  if (keep_rows) offset[0] = off;
  for (int64_t i = 1; i < n; ++i) {
    scalar_t* prev = keep_rows ? alpha_hat + (i - 1) * T : alpha_hat + ((i - 1) % 2) * T;
    row = keep_rows ? alpha_hat + i * T : alpha_hat + (i % 2) * T;
    forward_step(prev, trans, by_col, emit + i * T, row, scratch);
    off += normalise(row, T);
    if (keep_rows) offset[i] = off;
  }
  if (off == kNegInfD) return kNegInfD;
  return off + static_cast<double>(logsumexp_sum(row, 1, end, 1, T));
}

// Marginals of one sentence scaled by `g` into grad_emit (n, T); with kPairwise also the
// transition gradients, and the start / end ones where those are not null. alpha_hat / offset
// come from forward_scan(keep_rows).
template <typename scalar_t, bool kPairwise>
void backward_scan(const scalar_t* emit, const scalar_t* trans, const scalar_t* end,
                   const ScaledTransitions<scalar_t>& by_col,
                   const ScaledTransitions<scalar_t>& by_row, int64_t n, int64_t T,
                   const scalar_t* alpha_hat, const double* offset, double log_z, scalar_t g,
                   scalar_t* grad_emit, scalar_t* grad_trans, scalar_t* grad_start,
                   scalar_t* grad_end, scalar_t* beta_hat, scalar_t* beta_next, scalar_t* v,
                   scalar_t* scratch, scalar_t* pair) {
  for (int64_t t = 0; t < T; ++t) beta_hat[t] = end[t];
  double beta_off = normalise(beta_hat, T);
  for (int64_t i = n - 1; i >= 0; --i) {
    // Marginals at position i, normalised over tags rather than shifted by log Z: they sum to
    // one exactly, and a near-certain tag gets exactly 1 however large alpha and beta are
    // (a shift by log Z would carry log Z's rounding, ulp(|log Z|), into every probability).
    const scalar_t* alpha_i = alpha_hat + i * T;
    scalar_t* mu = grad_emit + i * T;
    for (int64_t t = 0; t < T; ++t) mu[t] = alpha_i[t] + beta_hat[t];
    const scalar_t u_max = max_of(mu, T);
    if (u_max == neg_inf<scalar_t>()) {  // unreachable when log Z is finite; keep zeros
      std::fill(mu, mu + T, scalar_t(0));
    } else {
      scalar_t total = 0;
      for (int64_t t = 0; t < T; ++t) total += (mu[t] = std::exp(mu[t] - u_max));
      const scalar_t scale = g / total;
      for (int64_t t = 0; t < T; ++t) mu[t] *= scale;
    }
    if (grad_end != nullptr && i == n - 1) std::copy(mu, mu + T, grad_end);
    if (grad_start != nullptr && i == 0) std::copy(mu, mu + T, grad_start);
    if (i == 0) break;

    for (int64_t t = 0; t < T; ++t) v[t] = emit[i * T + t] + beta_hat[t];
    if (kPairwise) {
      // xi[s, t] = P(y_{i-1} = s, y_i = t) = exp(alpha[i-1][s] + trans[s, t] + v[t] - log Z),
      // computed up to a common factor and then divided by its total (the xi sum to one), for
      // the same reason as the marginals above.
      const scalar_t* alpha_prev = alpha_hat + (i - 1) * T;  // normalised: max is 0 (or all -inf)
      const scalar_t pair_shift = static_cast<scalar_t>(offset[i - 1] + beta_off - log_z);
      for (int64_t s = 0; s < T; ++s) scratch[s] = std::exp(alpha_prev[s]);
      scalar_t total = 0;
      for (int64_t t = 0; t < T; ++t) {
        scalar_t* xi_t = pair + t * T;  // xi for one t, over s
        const scalar_t w = by_col.line_max[t] + v[t] + pair_shift;
        if (w == neg_inf<scalar_t>()) {
          std::fill(xi_t, xi_t + T, scalar_t(0));
        } else if (w <= pairwise_fast_bound<scalar_t>()) {
          const scalar_t coef = std::exp(w);
          const scalar_t* scaled = &by_col.scaled[t * T];
          for (int64_t s = 0; s < T; ++s) total += (xi_t[s] = coef * scratch[s] * scaled[s]);
        } else {
          for (int64_t s = 0; s < T; ++s) {
            total += (xi_t[s] = std::exp(alpha_prev[s] + trans[s * T + t] + v[t] + pair_shift));
          }
        }
      }
      if (total > 0) {
        const scalar_t scale = g / total;
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t s = 0; s < T; ++s) grad_trans[s * T + t] += scale * pair[t * T + s];
        }
      }
    }
    backward_step(v, trans, by_row, beta_next, scratch);
    std::copy(beta_next, beta_next + T, beta_hat);
    beta_off += normalise(beta_hat, T);
  }
}

// kLogPartitionWithMarginals is log Z together with its gradients for an upstream gradient of 1
// per sentence (the marginals and the expected transition counts), computed while each group's
// forward rows are still in cache: the backward of a differentiable log Z is then only these
// scaled by the upstream gradient (crfkit/backends/compiled.py).
enum class Output { kLogPartition, kLogPartitionWithMarginals, kMarginals, kBackward };

// Per-thread space for a lane group's rows (the ops other than log Z): kept between calls,
// because a fresh allocation of this size is a fresh mapping whose page faults cost more than
// the scan itself (measured: benchmarks/results/NOTES.md). Uninitialised: a group writes
// every row it reads. Sizes above kMaxKept doubles are not kept (they are freed when the
// thread's next call needs less).
inline double* lane_rows_workspace(int64_t size) {
  constexpr int64_t kMaxKept = int64_t(1) << 21;  // 16 MiB
  thread_local std::unique_ptr<double[]> buffer;
  thread_local int64_t capacity = 0;
  if (size > capacity || (capacity > kMaxKept && size <= kMaxKept)) {
    buffer.reset(new double[size]);
    capacity = size;
  }
  return buffer.get();
}

// One driver for the ops: they share the scans, the per-thread buffers, the checks.
// Each sentence runs the probability-space fast path (prob_space.h) and falls back to the exact
// log-space scans above when that path reports a value out of its range. Outputs that an op
// does not have are null (start_out / end_out may be null in the pairwise ops too).
template <typename scalar_t, Output kOut>
void forward_backward_batch(const Tensor& emissions, const Tensor& transitions,
                            const Tensor& lengths, const Tensor& start, const Tensor& end,
                            const scalar_t* grad_log_z, scalar_t* log_z_out, scalar_t* emit_out,
                            scalar_t* trans_out, scalar_t* start_out, scalar_t* end_out) {
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  const scalar_t* emit = emissions.mutable_data_ptr<scalar_t>();
  const scalar_t* trans = transitions.mutable_data_ptr<scalar_t>();
  const scalar_t* st = start.mutable_data_ptr<scalar_t>();
  const scalar_t* en = end.mutable_data_ptr<scalar_t>();
  const int64_t* len = lengths.mutable_data_ptr<int64_t>();
  const ProbTables tables(trans, en, T);
  constexpr bool writes_log_z = kOut == Output::kLogPartition || kOut == Output::kLogPartitionWithMarginals;
  constexpr bool keep_rows = kOut != Output::kLogPartition;
  constexpr bool pairwise = kOut == Output::kBackward || kOut == Output::kLogPartitionWithMarginals;
  // Only kBackward has an upstream gradient; the other outputs are for a gradient of 1 or have
  // none, and their grad_log_z is null: read it only through this flag (a read of it in a mode
  // without it is undefined behaviour that -O3 hides by dropping the dead load).
  constexpr bool has_upstream_gradient = kOut == Output::kBackward;
  const int64_t rows = keep_rows ? std::max<int64_t>(L, 1) : 2;
  std::vector<char> bad(B, 0);

  // Batch lanes first (prob_lanes.h), where the shape suits them; the sentences they do not
  // finish (failed lanes, length 0, NaN) go on to the per-sentence loop below.
  const bool lanes = tables.usable && use_lanes(B, T);
  std::vector<char> done(B, 0);
  // Whether a sentence's log Z came from its lane group's forward. If only the group's backward
  // failed, the per-sentence loop keeps that value (log_partition's), so that log Z does not
  // depend on which path computed the gradients.
  std::vector<char> has_log_z(B, 0);
  if (lanes) {
    const std::vector<int64_t> order = lane_order(len, B);
    const int64_t groups = static_cast<int64_t>(order.size()) / kGroup;
    // Groups come longest first; threads take them from a work queue (lanes.h for_each_group).
    for_each_group(groups, [&] { return ProbLaneWork(T, pairwise); }, [&](ProbLaneWork& work, int64_t grp) {
      double* rows_a = keep_rows ? lane_rows_workspace(2 * L * T * kGroup) : nullptr;
      double* rows_w = keep_rows ? rows_a + L * T * kGroup : nullptr;
      LaneGroup group(order.data() + grp * kGroup, len);
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t b = group.sentence[j];
        if (b < 0) continue;
        if (emit_out != nullptr) std::fill(emit_out + b * L * T, emit_out + (b + 1) * L * T, scalar_t(0));
        // NaN / +inf: left to the per-sentence loop, which reports it
        if (has_nan_or_posinf(emit + b * L * T, len[b] * T)) group.length[j] = 0;
        if (len[b] == 0) {  // the empty sequence: log Z = 0, nothing to differentiate
          if (writes_log_z) log_z_out[b] = 0;
          done[b] = 1;
        }
      }
      if (group.n_max == 0) return;  // only empty sentences: the per-sentence loop
      const LaneVector zero = {};
      LaneVector log_z = zero;
      const LaneMask finished = ~lanes_forward(emit, L, st, tables, group, work, rows_a, rows_w, log_z) &
                                (zero < group.length);
      LaneVector g = zero;
      for (int64_t j = 0; j < kGroup; ++j) {
        if (!finished[j]) continue;
        const int64_t b = group.sentence[j];
        if (writes_log_z) {
          log_z_out[b] = static_cast<scalar_t>(log_z[j]);
          has_log_z[b] = 1;
        }
        g[j] = has_upstream_gradient ? static_cast<double>(grad_log_z[b]) : 1.0;
      }
      if constexpr (keep_rows) {
        const LaneMask failed = lanes_backward<scalar_t, pairwise>(tables, group, work, rows_a, rows_w, g,
                                                                   ~finished, L, emit_out, trans_out,
                                                                   start_out, end_out);
        for (int64_t j = 0; j < kGroup; ++j) {
          if (finished[j] && !failed[j]) done[group.sentence[j]] = 1;
        }
      } else {
        for (int64_t j = 0; j < kGroup; ++j) {
          if (finished[j]) done[group.sentence[j]] = 1;
        }
      }
    });
  }

  // The sentences left for one-at-a-time scans (all of them without lanes).
  std::vector<int64_t> left;
  left.reserve(lanes ? 0 : B);
  for (int64_t b = 0; b < B; ++b) {
    if (!done[b]) left.push_back(b);
  }
  if (left.empty()) {
    raise_if_bad_emissions(bad);
    return;
  }
  // The exact log-space path's tables: 2 T^2 exponentials, made only when some sentence may
  // need them (after the lanes, usually none does).
  const ScaledTransitions<scalar_t> by_col(trans, T, /*by_column=*/true);
  const ScaledTransitions<scalar_t> by_row(trans, T, /*by_column=*/false);
  parallel_for(0, static_cast<int64_t>(left.size()), 1, [&](int64_t l_begin, int64_t l_end) {
    // Fast path: scaled probabilities in double. Exact path: normalised log space.
    const int64_t stride = tables.stride;
    std::vector<double> prob_a(rows * stride);
    std::vector<double> prob_w(keep_rows ? rows * stride : 0);
    std::vector<double> prob_work(3 * stride + (pairwise ? T * stride : 0));
    std::vector<scalar_t> alpha_hat(rows * T), work(4 * T + (pairwise ? T * T : 0));
    std::vector<double> offset(rows);
    for (int64_t l = l_begin; l < l_end; ++l) {
      const int64_t b = left[l];
      const int64_t n = len[b];
      const scalar_t* emit_b = emit + b * L * T;
      // The per-position outputs are allocated uninitialised: each sentence clears its share
      // here, in the thread that then writes it, so fresh pages are touched once, in parallel,
      // instead of by a separate serial zero fill first.
      if (emit_out != nullptr) std::fill(emit_out + b * L * T, emit_out + (b + 1) * L * T, scalar_t(0));
      if (has_nan_or_posinf(emit_b, n * T)) {
        bad[b] = 1;
        continue;
      }
      if (n == 0) {  // the empty sequence: log Z = 0, nothing to differentiate
        if (writes_log_z) log_z_out[b] = 0;
        continue;
      }
      scalar_t* grad_trans_b = pairwise ? trans_out + b * T * T : nullptr;
      auto exact_forward = [&] {
        return forward_scan(emit_b, trans, st, en, by_col, n, T, keep_rows, alpha_hat.data(),
                            offset.data(), work.data());
      };
      double log_z = 0;
      // Whether the probability-space forward stayed in its range (else the exact scan ran).
      const bool forward_in_prob_space =
          tables.usable &&
          prob_forward(emit_b, st, tables, n, keep_rows, prob_a.data(), prob_w.data(), prob_work.data(), &log_z);
      if (!forward_in_prob_space) log_z = exact_forward();
      if (writes_log_z && !has_log_z[b]) log_z_out[b] = static_cast<scalar_t>(log_z);
      if constexpr (keep_rows) {
        // Every sequence forbidden: log Z = -inf and all gradients / marginals stay 0.
        if (log_z == kNegInfD) continue;
        const scalar_t g = has_upstream_gradient ? grad_log_z[b] : scalar_t(1);
        if (g == 0) continue;
        scalar_t* grad_emit_b = emit_out + b * L * T;
        scalar_t* grad_start_b = start_out != nullptr ? start_out + b * T : nullptr;
        scalar_t* grad_end_b = end_out != nullptr ? end_out + b * T : nullptr;
        if (forward_in_prob_space &&
            prob_backward<scalar_t, pairwise>(tables, n, prob_a.data(), prob_w.data(), g, grad_emit_b, grad_trans_b,
                                              grad_start_b, grad_end_b, prob_work.data())) {
          continue;
        }
        // The probability-space backward left its range: discard its partial sums, redo exactly.
        if (forward_in_prob_space) {
          if (pairwise) std::fill(grad_trans_b, grad_trans_b + T * T, scalar_t(0));
          log_z = exact_forward();
        }
        backward_scan<scalar_t, pairwise>(
            emit_b, trans, en, by_col, by_row, n, T, alpha_hat.data(), offset.data(), log_z, g,
            grad_emit_b, grad_trans_b, grad_start_b, grad_end_b, work.data(), work.data() + T,
            work.data() + 2 * T, work.data() + 3 * T, pairwise ? work.data() + 4 * T : nullptr);
      }
    }
  });
  raise_if_bad_emissions(bad);
}

}  // namespace

// log Z per sentence: (B,). Working memory O(T) per thread; nothing of size L is kept.
Tensor log_partition_cpu(const Tensor& emissions_in, const Tensor& transitions_in,
                             const Tensor& lengths_in, const Tensor& start_in,
                             const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return log_partition_per_example(emissions_in, transitions_in, lengths_in, start_in, end_in);
  }
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  auto log_z = empty({emissions.size(0)}, options_of(emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition", [&] {
    forward_backward_batch<scalar_t, Output::kLogPartition>(emissions, transitions, lengths, start, end,
                                                            nullptr, log_z.mutable_data_ptr<scalar_t>(), nullptr,
                                                            nullptr, nullptr, nullptr);
  });
  return log_z;
}

// P(y_i = t | x): (B, L, T), zero at padded positions.
Tensor marginals_cpu(const Tensor& emissions_in, const Tensor& transitions_in,
                         const Tensor& lengths_in, const Tensor& start_in, const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return marginals_per_example(emissions_in, transitions_in, lengths_in, start_in, end_in);
  }
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  auto marginals = empty_as(emissions);  // zeroed per sentence by the kernel
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_marginals", [&] {
    forward_backward_batch<scalar_t, Output::kMarginals>(emissions, transitions, lengths, start, end,
                                                         nullptr, nullptr, marginals.mutable_data_ptr<scalar_t>(),
                                                         nullptr, nullptr, nullptr);
  });
  return marginals;
}

// Gradients of sum_b grad_log_z[b] * log Z[b] with respect to emissions (B, L, T),
// transitions (T, T), start (T,) and end (T,): the marginals and pairwise marginals, weighted.
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_cpu(
    const Tensor& grad_log_z_in, const Tensor& emissions_in, const Tensor& transitions_in,
    const Tensor& lengths_in, const Tensor& start_in, const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return log_partition_backward_per_example(grad_log_z_in, emissions_in, transitions_in, lengths_in, start_in,
                                              end_in);
  }
  const Tensor grad_log_z = as_contiguous(grad_log_z_in);
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  const int64_t B = emissions.size(0), T = emissions.size(2);
  check_argument_like(grad_log_z, "grad_log_z", "(batch,)", {B}, emissions, "emissions");
  auto grad_emissions = empty_as(emissions);  // zeroed per sentence by the kernel
  // Per-sentence partial sums, reduced in a fixed order afterwards: deterministic.
  auto grad_trans = zeros({B, T, T}, options_of(emissions));
  auto grad_start = zeros({B, T}, options_of(emissions));
  auto grad_end = zeros({B, T}, options_of(emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition_backward", [&] {
    forward_backward_batch<scalar_t, Output::kBackward>(
        emissions, transitions, lengths, start, end, grad_log_z.mutable_data_ptr<scalar_t>(), nullptr,
        grad_emissions.mutable_data_ptr<scalar_t>(), grad_trans.mutable_data_ptr<scalar_t>(),
        grad_start.mutable_data_ptr<scalar_t>(), grad_end.mutable_data_ptr<scalar_t>());
  });
  return {grad_emissions, sum_first_dim(grad_trans), sum_first_dim(grad_start), sum_first_dim(grad_end)};
}

// log Z (B,) and its gradients for grad_log_z = 1: the marginals (B, L, T), which are also the
// gradients with respect to emissions, start (marginals[:, 0]) and end (each sentence's last
// row), and the expected transition counts (B, T, T), the per-sentence gradients with respect to
// transitions. Used when log Z will be differentiated (crfkit/backends/compiled.py): the backward for any
// upstream gradient is then these scaled, and the forward recursion runs once per step, its
// rows never leaving the cache (the backward is linear in the upstream gradient).
std::tuple<Tensor, Tensor, Tensor> log_partition_with_marginals_cpu(
    const Tensor& emissions_in, const Tensor& transitions_in, const Tensor& lengths_in,
    const Tensor& start_in, const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return log_partition_with_marginals_per_example(emissions_in, transitions_in, lengths_in, start_in, end_in);
  }
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  const int64_t B = emissions.size(0), T = emissions.size(2);
  auto log_z = empty({B}, options_of(emissions));
  // Recycled memory (recycled_memory.h): fresh blocks this size would page-fault on every step.
  auto marginals = recycled_tensor(emissions.sizes(), emissions.scalar_type());  // zeroed per sentence by the kernel
  auto counts = zeroed(recycled_tensor({B, T, T}, emissions.scalar_type()));
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition_with_marginals", [&] {
    forward_backward_batch<scalar_t, Output::kLogPartitionWithMarginals>(
        emissions, transitions, lengths, start, end, nullptr, log_z.mutable_data_ptr<scalar_t>(),
        marginals.mutable_data_ptr<scalar_t>(), counts.mutable_data_ptr<scalar_t>(), nullptr, nullptr);
  });
  return {log_z, marginals, counts};
}

// The backward of log_partition_with_marginals: the gradients of sum_b grad_log_z[b] log Z[b]
// with respect to emissions (B, L, T), transitions (T, T), start (T,) and end (T,), from that
// op's marginals (B, L, T) and expected transition counts (B, T, T). d/d start is the marginals
// at position 0, d/d end those at each sentence's last position. One pass over the marginals;
// the sums over sentences run in sentence order (deterministic).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_from_marginals_cpu(
    const Tensor& grad_log_z_in, const Tensor& marginals_in, const Tensor& counts_in,
    const Tensor& lengths_in) {
  // Per-example counts (B, Lt, T, T), from per-example transitions: per-example gradients.
  if (counts_in.dim() == 4) {
    return log_partition_backward_from_marginals_per_example(grad_log_z_in, marginals_in, counts_in, lengths_in);
  }
  const Tensor grad_log_z = as_contiguous(grad_log_z_in), marginals = as_contiguous(marginals_in),
                   counts = as_contiguous(counts_in), lengths = as_contiguous(lengths_in);
  check_backward_from_marginals_arguments(grad_log_z, marginals, counts, lengths);
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2);
  check_lengths_cpu(lengths, L);
  // Recycled memory (recycled_memory.h), as the marginals: a fresh block page-faults every step.
  auto grad_emissions = recycled_tensor(marginals.sizes(), marginals.scalar_type());
  auto grad_trans = empty({T, T}, options_of(marginals));
  auto grad_start = zeros({T}, options_of(marginals));
  auto grad_end = zeros({T}, options_of(marginals));
  CRFKIT_DISPATCH_FLOATING_TYPES(marginals.scalar_type(), "crfkit_log_partition_backward_from_marginals", [&] {
    const scalar_t* g = grad_log_z.mutable_data_ptr<scalar_t>();
    const scalar_t* mu = marginals.mutable_data_ptr<scalar_t>();
    const scalar_t* cnt = counts.mutable_data_ptr<scalar_t>();
    const int64_t* len = lengths.mutable_data_ptr<int64_t>();
    scalar_t* out = grad_emissions.mutable_data_ptr<scalar_t>();
    // Positions past a sentence's length stay exactly 0 (also for an infinite g).
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t used = len[b] * T;
        for (int64_t k = 0; k < used; ++k) out[b * L * T + k] = g[b] * mu[b * L * T + k];
        std::fill(out + b * L * T + used, out + (b + 1) * L * T, scalar_t(0));
      }
    });
    scalar_t* trans_out = grad_trans.mutable_data_ptr<scalar_t>();
    parallel_for(0, T * T, 256, [&](int64_t k_begin, int64_t k_end) {
      for (int64_t k = k_begin; k < k_end; ++k) trans_out[k] = 0;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t k = k_begin; k < k_end; ++k) trans_out[k] += g[b] * cnt[b * T * T + k];
      }
    });
    scalar_t* start_out = grad_start.mutable_data_ptr<scalar_t>();
    scalar_t* end_out = grad_end.mutable_data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      if (len[b] == 0) continue;
      const scalar_t* first = mu + b * L * T;
      const scalar_t* last = first + (len[b] - 1) * T;
      for (int64_t t = 0; t < T; ++t) {
        start_out[t] += g[b] * first[t];
        end_out[t] += g[b] * last[t];
      }
    }
  });
  return {grad_emissions, grad_trans, grad_start, grad_end};
}

// E[number of s -> t transitions] per sentence: (B, T, T). The per-sentence partial sums of
// the transitions' gradient of log Z (grad_log_z = 1), left unreduced: the same scan as
// log_partition_with_marginals, whose log Z and marginals are dropped.
Tensor expected_transition_counts_cpu(const Tensor& emissions, const Tensor& transitions,
                                          const Tensor& lengths, const Tensor& start,
                                          const Tensor& end) {
  if (transitions.dim() == 4) {  // summed over positions, also for Lt = L (per_example.cpp)
    return expected_transition_counts_per_example(emissions, transitions, lengths, start, end);
  }
  return std::get<2>(log_partition_with_marginals_cpu(emissions, transitions, lengths, start, end));
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
