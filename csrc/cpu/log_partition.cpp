// CPU kernels: log partition (forward algorithm), marginals and the analytic backward of log Z
// (forward-backward). Parallel over sentences. From 8 sentences on (T <= 64) they are scanned 8
// at a time, one per SIMD lane (prob_lanes.h); otherwise, and for any sentence a lane group
// cannot finish, one sentence per scan (prob_space.h, then log_space.h).
//
// Layout: emissions (B, L, T) contiguous, transitions (T, T) as [from, to], start / end (T,),
// lengths (B,) int64. Sentence b uses positions 0 .. lengths[b]-1; padded positions are never
// read and get zero marginals / gradients. A length-0 sentence has exactly one (empty) tag
// sequence of score 0: log Z = 0 and no marginals.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <memory>

#include "../checks.h"
#include "log_space.h"
#include "prob_lanes.h"
#include "prob_space.h"
#include "state_cache.h"

namespace crfkit {
namespace cpu {
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

// Marginals of one sentence scaled by `g` into grad_emit (n, T); with kPairwise also
// the transition / start / end gradients. alpha_hat / offset come from forward_scan(keep_rows).
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
    if (kPairwise && i == n - 1) std::copy(mu, mu + T, grad_end);
    if (kPairwise && i == 0) std::copy(mu, mu + T, grad_start);
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

// kLogPartitionSaving is log Z that also keeps the forward pass's state for the backward
// (kBackwardFromState), so that training runs the forward recursion once instead of twice.
enum class Output { kLogPartition, kLogPartitionSaving, kMarginals, kBackward, kBackwardFromState };

// What the saved state holds for sentence b (the `status` tensor).
enum SavedStatus : uint8_t {
  kRecompute = 0,   // the fast path left its range: the backward recomputes exactly
  kFastState = 1,   // state[b] holds the scaled forward rows a (n, stride) and w (n, stride)
  kNoGradient = 2,  // length 0, or log Z = -inf: every gradient is 0
  kLaneState = 3,   // the rows are in its lane group's share of the state (prob_lanes.h)
};

// Forward state of the probability-space path: (B rounded up to kGroup, 2, L, stride) double,
// where stride = T rounded up to a whole number of lanes (padded_tags). Per-sentence scans use
// slot b: a rows (L, stride) then w rows (L, stride), zero padded. Lane groups (prob_lanes.h)
// use the kGroup slots of group g together: a rows (L, T, kGroup) then w rows (L, T, kGroup),
// which fit since stride >= T.
struct ForwardState {
  double* rows = nullptr;     // nullptr when the op keeps no state
  uint8_t* status = nullptr;  // (B,) SavedStatus
  int64_t L = 0, stride = 0;
  double* a_rows(int64_t b) const { return rows + b * 2 * L * stride; }
  double* w_rows(int64_t b) const { return rows + (b * 2 + 1) * L * stride; }
  double* group_a_rows(int64_t g) const { return rows + g * kGroup * 2 * L * stride; }
  double* group_w_rows(int64_t g, int64_t T) const { return group_a_rows(g) + L * T * kGroup; }
};

inline int64_t state_slots(int64_t B) { return (B + kGroup - 1) / kGroup * kGroup; }

// Per-thread space for a lane group's rows when the op keeps no state (marginals, the backward
// that recomputes the forward): kept between calls, because a fresh allocation of this size is
// a fresh mapping whose page faults cost more than the scan itself (measured: 0.2 ms per call at
// (32, 128, 9)). Uninitialised: a group writes every row it reads. Sizes above kMaxKept doubles
// are not kept (they are freed when the thread's next call needs less).
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
// log-space scans above when that path reports a value out of its range.
template <typename scalar_t, Output kOut>
void run_sentences(const at::Tensor& emissions, const at::Tensor& transitions,
                   const at::Tensor& start, const at::Tensor& end, const at::Tensor& lengths,
                   const scalar_t* grad_log_z, scalar_t* log_z_out, scalar_t* emit_out,
                   scalar_t* trans_out, scalar_t* start_out, scalar_t* end_out,
                   const ForwardState& state = {}) {
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  const scalar_t* emit = emissions.data_ptr<scalar_t>();
  const scalar_t* trans = transitions.data_ptr<scalar_t>();
  const scalar_t* st = start.data_ptr<scalar_t>();
  const scalar_t* en = end.data_ptr<scalar_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const ProbTables tables(trans, en, T);
  constexpr bool saving = kOut == Output::kLogPartitionSaving;
  constexpr bool from_state = kOut == Output::kBackwardFromState;
  constexpr bool writes_log_z = kOut == Output::kLogPartition || saving;
  constexpr bool keep_rows = kOut != Output::kLogPartition;
  constexpr bool pairwise = kOut == Output::kBackward || from_state;
  const int64_t rows = keep_rows ? std::max<int64_t>(L, 1) : 2;
  std::vector<char> bad(B, 0);

  // Batch lanes first (prob_lanes.h), where the shape suits them; the sentences they do not
  // finish (failed lanes, length 0, NaN) go on to the per-sentence loop below. The choice
  // depends only on (B, T, transitions), so the backward from a saved state makes it again.
  const bool lanes = tables.usable && use_lanes(B, T);
  std::vector<char> done(B, 0);
  if (lanes) {
    const std::vector<int64_t> order = lane_order(len, B);
    const int64_t groups = static_cast<int64_t>(order.size()) / kGroup;
    const bool own_rows = keep_rows && !(saving || from_state);
    // Groups come longest first; threads take them from a work queue (lanes.h for_each_group).
    for_each_group(groups, [&] { return ProbLaneWork(T, pairwise); }, [&](ProbLaneWork& work, int64_t grp) {
      double* own_rows_buffer = own_rows ? lane_rows_workspace(2 * L * T * kGroup) : nullptr;
      LaneGroup group(order.data() + grp * kGroup, len);
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t b = group.sentence[j];
        if (b < 0) continue;
        if (emit_out != nullptr) std::fill(emit_out + b * L * T, emit_out + (b + 1) * L * T, scalar_t(0));
        // NaN / +inf: left to the per-sentence loop, which reports it
        if (has_nan_or_posinf(emit + b * L * T, len[b] * T)) group.length[j] = 0;
        if (len[b] == 0) {  // the empty sequence: log Z = 0, nothing to differentiate
          if (writes_log_z) log_z_out[b] = 0;
          if (saving) state.status[b] = kNoGradient;
          done[b] = 1;
        }
      }
      if (saving) {  // lanes_forward writes the rows before n_max; the rest must not be leftovers
        std::fill(state.group_a_rows(grp) + group.n_max * T * kGroup, state.group_w_rows(grp, T), 0.0);
        std::fill(state.group_w_rows(grp, T) + group.n_max * T * kGroup, state.group_a_rows(grp + 1), 0.0);
      }
      if (group.n_max == 0) return;  // only empty sentences: the per-sentence loop
      double* rows_a = from_state || saving ? state.group_a_rows(grp) : own_rows_buffer;
      double* rows_w = from_state || saving ? state.group_w_rows(grp, T) : own_rows_buffer + L * T * kGroup;
      const LaneVector zero = {};
      LaneMask finished = {};  // forward done (or, from a saved state, valid)
      if (from_state) {
        for (int64_t j = 0; j < kGroup; ++j) {
          const int64_t b = group.sentence[j];
          finished[j] = b >= 0 && group.length[j] > 0 && state.status[b] == kLaneState;
        }
      } else {
        LaneVector log_z = zero;
        finished = ~lanes_forward(emit, L, st, tables, group, work, keep_rows ? rows_a : nullptr,
                                  rows_w, log_z) &
                   (zero < group.length);
        for (int64_t j = 0; j < kGroup; ++j) {
          if (!finished[j]) continue;
          const int64_t b = group.sentence[j];
          if (writes_log_z) {
            log_z_out[b] = static_cast<scalar_t>(log_z[j]);
            done[b] = 1;
          }
          if (saving) state.status[b] = kLaneState;
        }
      }
      if constexpr (!writes_log_z) {
        LaneVector g = zero;
        for (int64_t j = 0; j < kGroup; ++j) {
          if (finished[j]) g[j] = kOut == Output::kMarginals ? 1.0 : static_cast<double>(grad_log_z[group.sentence[j]]);
        }
        const LaneMask failed = lanes_backward<scalar_t, pairwise>(
            tables, group, work, rows_a, rows_w, g, ~finished, L, emit_out, trans_out,
            start_out, end_out);
        for (int64_t j = 0; j < kGroup; ++j) {
          if (finished[j] && !failed[j]) done[group.sentence[j]] = 1;
        }
      }
    });
  } else if (saving) {  // the slots past B (B rounded up to kGroup) are not a sentence's
    std::fill(state.a_rows(B), state.a_rows(state_slots(B)), 0.0);
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
  at::parallel_for(0, static_cast<int64_t>(left.size()), 1, [&](int64_t l_begin, int64_t l_end) {
    // Fast path: scaled probabilities in double (in the saved state when there is one).
    // Exact path: normalised log space. After the lanes, a sentence keeps nothing in the
    // state (its slot belongs to its group): saving marks it for an exact recompute.
    const bool own_rows = !(saving || from_state) || lanes;
    const int64_t stride = tables.stride;
    std::vector<double> prob_a(own_rows ? rows * stride : 0);
    std::vector<double> prob_w(own_rows && keep_rows ? rows * stride : 0);
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
      if (saving && !lanes) std::fill(state.a_rows(b), state.a_rows(b + 1), 0.0);
      if (has_nan_or_posinf(emit_b, n * T)) {
        bad[b] = 1;
        continue;
      }
      if (n == 0) {  // the empty sequence: log Z = 0, nothing to differentiate
        if (writes_log_z) log_z_out[b] = 0;
        if (saving) state.status[b] = kNoGradient;
        continue;
      }
      double* a_rows = own_rows ? prob_a.data() : state.a_rows(b);
      double* w_rows = own_rows ? prob_w.data() : state.w_rows(b);
      auto exact_forward = [&] {
        return forward_scan(emit_b, trans, st, en, by_col, n, T, keep_rows, alpha_hat.data(),
                            offset.data(), work.data());
      };
      double log_z = 0;
      bool fast = false;
      if (from_state) {  // the forward already ran: its state says what is left to do
        TORCH_CHECK(state.status[b] <= (lanes ? kLaneState : kNoGradient),
                    "crfkit: invalid saved forward state");
        if (state.status[b] == kNoGradient) continue;
        fast = state.status[b] == kFastState && !lanes;  // kLaneState here: the lanes failed
        if (!fast) log_z = exact_forward();
      } else {
        fast = tables.usable && prob_forward(emit_b, st, tables, n, keep_rows, a_rows, w_rows,
                                             prob_work.data(), &log_z);
        if (!fast) log_z = exact_forward();
      }
      if (writes_log_z) {
        log_z_out[b] = static_cast<scalar_t>(log_z);
        if (saving) {
          state.status[b] = log_z == kNegInfD ? kNoGradient : fast && !lanes ? kFastState : kRecompute;
        }
        continue;
      }
      // Every sequence forbidden: log Z = -inf and all gradients / marginals stay 0.
      if (log_z == kNegInfD) continue;
      const scalar_t g = kOut == Output::kMarginals ? scalar_t(1) : grad_log_z[b];
      if (g == 0) continue;
      scalar_t* grad_emit_b = emit_out + b * L * T;
      scalar_t* grad_trans_b = pairwise ? trans_out + b * T * T : nullptr;
      scalar_t* grad_start_b = pairwise ? start_out + b * T : nullptr;
      scalar_t* grad_end_b = pairwise ? end_out + b * T : nullptr;
      if (fast && prob_backward<scalar_t, pairwise>(tables, n, a_rows, w_rows, g,
                                                    grad_emit_b, grad_trans_b, grad_start_b,
                                                    grad_end_b, prob_work.data())) {
        continue;
      }
      if (fast) {  // the backward left its range: discard its partial sums, redo exactly
        if (pairwise) std::fill(grad_trans_b, grad_trans_b + T * T, scalar_t(0));
        log_z = exact_forward();
      }
      backward_scan<scalar_t, pairwise>(
          emit_b, trans, en, by_col, by_row, n, T, alpha_hat.data(), offset.data(), log_z, g,
          grad_emit_b, grad_trans_b, grad_start_b, grad_end_b, work.data(), work.data() + T,
          work.data() + 2 * T, work.data() + 3 * T, pairwise ? work.data() + 4 * T : nullptr);
    }
  });
  raise_if_bad_emissions(bad);
}

// log Z per sentence: (B,). Working memory O(T) per thread; nothing of size L is kept.
at::Tensor log_partition_cpu(const at::Tensor& emissions_in, const at::Tensor& transitions_in,
                             const at::Tensor& start_in, const at::Tensor& end_in,
                             const at::Tensor& lengths_in) {
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  auto log_z = at::empty({emissions.size(0)}, emissions.options());
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition", [&] {
    run_sentences<scalar_t, Output::kLogPartition>(emissions, transitions, start, end, lengths,
                                                   nullptr, log_z.data_ptr<scalar_t>(), nullptr,
                                                   nullptr, nullptr, nullptr);
  });
  return log_z;
}

// P(y_i = t | x): (B, L, T), zero at padded positions.
at::Tensor marginals_cpu(const at::Tensor& emissions_in, const at::Tensor& transitions_in,
                         const at::Tensor& start_in, const at::Tensor& end_in, const at::Tensor& lengths_in) {
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  auto marginals = at::empty_like(emissions);  // zeroed per sentence by the kernel
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_marginals", [&] {
    run_sentences<scalar_t, Output::kMarginals>(emissions, transitions, start, end, lengths,
                                                nullptr, nullptr, marginals.data_ptr<scalar_t>(),
                                                nullptr, nullptr, nullptr);
  });
  return marginals;
}

// Gradients of sum_b grad_log_z[b] * log Z[b] with respect to emissions (B, L, T),
// transitions (T, T), start (T,) and end (T,): the marginals and pairwise marginals, weighted.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> log_partition_backward_cpu(
    const at::Tensor& grad_log_z_in, const at::Tensor& emissions_in, const at::Tensor& transitions_in,
    const at::Tensor& start_in, const at::Tensor& end_in, const at::Tensor& lengths_in) {
  const at::Tensor grad_log_z = grad_log_z_in.contiguous();
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const int64_t B = emissions.size(0), T = emissions.size(2);
  TORCH_CHECK(grad_log_z.dim() == 1 && grad_log_z.size(0) == B &&
                  grad_log_z.scalar_type() == emissions.scalar_type(),
              "crfkit: grad_log_z must be (batch,) with the dtype of emissions");
  auto grad_emissions = at::empty_like(emissions);  // zeroed per sentence by the kernel
  // Per-sentence partial sums, reduced in a fixed order afterwards: deterministic.
  auto grad_trans = at::zeros({B, T, T}, emissions.options());
  auto grad_start = at::zeros({B, T}, emissions.options());
  auto grad_end = at::zeros({B, T}, emissions.options());
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition_backward", [&] {
    run_sentences<scalar_t, Output::kBackward>(
        emissions, transitions, start, end, lengths, grad_log_z.data_ptr<scalar_t>(), nullptr,
        grad_emissions.data_ptr<scalar_t>(), grad_trans.data_ptr<scalar_t>(),
        grad_start.data_ptr<scalar_t>(), grad_end.data_ptr<scalar_t>());
  });
  return {grad_emissions, grad_trans.sum(0), grad_start.sum(0), grad_end.sum(0)};
}

// log Z (B,) plus the state its backward needs: the scaled forward rows (slots, 2, L, stride)
// double (slots: B rounded up to 8, stride: T rounded up to 8; see ForwardState) and a status per
// sentence (B,) uint8 (SavedStatus). Used when log Z will be differentiated, so that the backward
// does not run the forward recursion again; costs 16 * slots * L * stride bytes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> log_partition_saving_cpu(
    const at::Tensor& emissions_in, const at::Tensor& transitions_in, const at::Tensor& start_in,
    const at::Tensor& end_in, const at::Tensor& lengths_in) {
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  auto log_z = at::empty({B}, emissions.options());
  // Zeroed per sentence by the kernel: rows past a sentence's length are never written, and an
  // op's outputs must not depend on leftover memory (torch.compile and opcheck compare runs).
  const int64_t stride = padded_tags(T);
  // Recycled memory (state_cache.h): a fresh block this size would page-fault on every call.
  auto rows = recycled_double_tensor({state_slots(B), 2, L, stride});
  auto status = at::empty({B}, emissions.options().dtype(at::kByte));
  const ForwardState state{rows.data_ptr<double>(), status.data_ptr<uint8_t>(), L, stride};
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition_saving", [&] {
    run_sentences<scalar_t, Output::kLogPartitionSaving>(emissions, transitions, start, end, lengths,
                                                         nullptr, log_z.data_ptr<scalar_t>(), nullptr,
                                                         nullptr, nullptr, nullptr, state);
  });
  return {log_z, rows, status};
}

// log_partition_backward from the state of log_partition_saving (same inputs, same results).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> log_partition_backward_saved_cpu(
    const at::Tensor& grad_log_z_in, const at::Tensor& emissions_in, const at::Tensor& transitions_in,
    const at::Tensor& start_in, const at::Tensor& end_in, const at::Tensor& lengths_in,
    const at::Tensor& rows_in, const at::Tensor& status_in) {
  const at::Tensor grad_log_z = grad_log_z_in.contiguous();
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  TORCH_CHECK(grad_log_z.dim() == 1 && grad_log_z.size(0) == B &&
                  grad_log_z.scalar_type() == emissions.scalar_type(),
              "crfkit: grad_log_z must be (batch,) with the dtype of emissions");
  TORCH_CHECK(rows_in.scalar_type() == at::kDouble && rows_in.dim() == 4 &&
                  rows_in.size(0) == state_slots(B) &&
                  rows_in.size(1) == 2 && rows_in.size(2) == L && rows_in.size(3) == padded_tags(T),
              "crfkit: saved forward rows must be (batch rounded up to 8, 2, seq_len, num_tags "
              "rounded up to 8) float64");
  TORCH_CHECK(status_in.scalar_type() == at::kByte && status_in.dim() == 1 && status_in.size(0) == B,
              "crfkit: saved forward status must be (batch,) uint8");
  const at::Tensor rows = rows_in.contiguous(), status = status_in.contiguous();
  auto grad_emissions = at::empty_like(emissions);  // zeroed per sentence by the kernel
  auto grad_trans = at::zeros({B, T, T}, emissions.options());
  auto grad_start = at::zeros({B, T}, emissions.options());
  auto grad_end = at::zeros({B, T}, emissions.options());
  // The kernel only reads the state; ForwardState has mutable pointers for the saving op.
  const ForwardState state{const_cast<double*>(rows.data_ptr<double>()),
                           const_cast<uint8_t*>(status.data_ptr<uint8_t>()), L,
                           padded_tags(T)};
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_log_partition_backward_saved", [&] {
    run_sentences<scalar_t, Output::kBackwardFromState>(
        emissions, transitions, start, end, lengths, grad_log_z.data_ptr<scalar_t>(), nullptr,
        grad_emissions.data_ptr<scalar_t>(), grad_trans.data_ptr<scalar_t>(),
        grad_start.data_ptr<scalar_t>(), grad_end.data_ptr<scalar_t>(), state);
  });
  return {grad_emissions, grad_trans.sum(0), grad_start.sum(0), grad_end.sum(0)};
}

// E[number of s -> t transitions] per sentence: (B, T, T). The per-sentence partial sums of
// the transitions' gradient of log Z (grad_log_z = 1), left unreduced.
at::Tensor expected_transition_counts_cpu(const at::Tensor& emissions_in, const at::Tensor& transitions_in,
                                          const at::Tensor& start_in, const at::Tensor& end_in,
                                          const at::Tensor& lengths_in) {
  const auto [emissions, transitions, start, end, lengths] =
      checked_cpu_args(emissions_in, transitions_in, start_in, end_in, lengths_in);
  const int64_t B = emissions.size(0), T = emissions.size(2);
  auto ones = at::ones({B}, emissions.options());
  auto grad_emissions = at::empty_like(emissions);  // zeroed per sentence by the kernel
  auto counts = at::zeros({B, T, T}, emissions.options());
  auto grad_start = at::zeros({B, T}, emissions.options());
  auto grad_end = at::zeros({B, T}, emissions.options());
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_expected_transition_counts", [&] {
    run_sentences<scalar_t, Output::kBackward>(
        emissions, transitions, start, end, lengths, ones.data_ptr<scalar_t>(), nullptr,
        grad_emissions.data_ptr<scalar_t>(), counts.data_ptr<scalar_t>(),
        grad_start.data_ptr<scalar_t>(), grad_end.data_ptr<scalar_t>());
  });
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(crfkit, CPU, m) {
  m.impl("log_partition", &log_partition_cpu);
  m.impl("log_partition_saving", &log_partition_saving_cpu);
  m.impl("marginals", &marginals_cpu);
  m.impl("log_partition_backward", &log_partition_backward_cpu);
  m.impl("log_partition_backward_saved", &log_partition_backward_saved_cpu);
  m.impl("expected_transition_counts", &expected_transition_counts_cpu);
}

}  // namespace cpu
}  // namespace crfkit
