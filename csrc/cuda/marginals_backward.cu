// CUDA kernels of marginals_backward: the vector-Jacobian product of the marginals with an
// upstream gradient V (B, L, T), for emissions, transitions, start and end; and of
// expected_transition_counts_backward, the same for the expected transition counts with an
// upstream gradient W (B, T, T).
//
// The same mathematics as the CPU kernel (csrc/cpu/marginals_backward.cpp, where the formulas
// are derived): a Hessian-vector product of log Z, computed as the tangent of the
// forward-backward recursions in the direction V. Per sentence of length n >= 1, with P_i, Q_i
// the softmax weights of the forward and backward lines:
//   a_0 = V_0,  a_i(j) = sum_s P_i(s|j) a_{i-1}(s) + V_i(j)            (tangent of alpha)
//   b_{n-1} = 0,  b_i(s) = sum_j Q_i(j|s) (V_{i+1}(j) + b_{i+1}(j))     (tangent of beta)
//   dmu_i(j) = mu_i(j) (a_i(j) + b_i(j) - z_i),  z_i = sum_j mu_i(j) (a_i(j) + b_i(j))
//   dxi_i(s, j) = P_i(s|j) (mu_i(j) (a_{i-1}(s) - mean_i(j)) + dmu_i(j)),  mean_i(j) = sum_s P_i(s|j) a_{i-1}(s)
// grad_emissions = dmu (0 beyond the length), grad_transitions = sum over sentences and i >= 1 of
// dxi_i, grad_start = sum of dmu_0, grad_end = sum of dmu_{n-1}. For the counts the direction is
// W_b in the transitions (V = 0): the term s of the forward line j, of dxi_i(s, j) and of the
// backward line s moves by W(s, j) as well (the CPU file's comment derives it).
//
// Layout: one WARP per sentence (not the G-lane groups of common.cuh): the warp's control flow
// then depends on its own sentence only (its length, and whether log Z is -inf), so the early
// exits need no predication. Lane l owns the tags l, l + 32, ...; for T < 32 lanes idle, which
// this op (a second derivative, used by TOKEN-POS distillation with a CRF student) can afford.
// Every line is the exact max-shifted logsumexp in double (no factored tables): the tangents
// are differences of means, where float32 would lose digits, and an exact line cannot
// underflow. The forward keeps its rows (alpha, a, mean and the line's log-normaliser, O(L T)
// per warp) in a global workspace; the rows each lane reads from the others are published with
// __syncwarp. The warps are persistent (each walks sentences w, w + warps, ...) and their count
// is bounded by the device and by kWorkspaceBudget, so the workspace does not grow with B.
// Sums over sentences go to per-warp accumulators, reduced afterwards in a fixed order: the
// result is deterministic for a given device.
//
// -inf scores give weights exactly 0 (lines whose terms are all -inf are skipped), and the
// tangents stay finite, so no NaN arises; a sentence whose sequences are all forbidden, and a
// length-0 sentence, get zero gradients. Padded positions of emissions and V are never read.
#include "common.cuh"

namespace crfkit {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
// Bytes of per-warp workspace one call may allocate; fewer warps (each taking more sentences)
// beyond it.
constexpr int64_t kWorkspaceBudget = int64_t(256) << 20;
// The warp's rows: forward (L, T) each, then backward (T,) each.
enum ForwardRow { kAlpha, kTangent, kMean, kLineLse, kNumForwardRows };
enum BackwardRow { kBeta, kBetaTangent, kValue, kValueTangent, kMu, kMuTangent, kNumBackwardRows };

template <typename scalar_t>
struct MarginalsBackwardParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  long long* status;
  int64_t batch = 0, max_len = 0;
  int num_tags = 0;
  const scalar_t* grad;         // V (B, L, T), or null: no direction in the emissions
  const scalar_t* grad_counts;  // W (B, T, T) [from][to], or null: no direction in the transitions
  scalar_t* grad_emissions;     // (B, L, T), zero-initialised
  double* forward_rows;         // (warps, kNumForwardRows, L, T)
  double* backward_rows;        // (warps, kNumBackwardRows, T)
  double* pair_sums;            // (warps, T, T) [from][to], zero-initialised
  double* start_sums;           // (warps, T), zero-initialised
  double* end_sums;             // (warps, T), zero-initialised
};

__device__ __forceinline__ double warp_sum(double v) { return group_sum(v, kWarpSize); }
__device__ __forceinline__ double warp_max_of(double v) { return group_max(v, kWarpSize); }

// One line of a recursion and of its tangent: out = lse_m(x[m] + line[m * stride]) and
// mean = sum_m w[m] (dx[m] + dir[m * stride]), w the line's softmax weights, dir (null: 0) the
// transitions' tangent laid out as line. out = -inf, mean = 0 when every term is -inf.
template <typename scalar_t>
__device__ __forceinline__ void tangent_line(const double* x, const double* dx, const scalar_t* line,
                                             const scalar_t* dir, int64_t stride, int T, double& out, double& mean) {
  double top = neg_inf<double>();
  for (int m = 0; m < T; ++m) top = max_(top, x[m] + static_cast<double>(line[m * stride]));
  if (top == neg_inf<double>()) {
    out = top;
    mean = 0;
    return;
  }
  double sum = 0, weighted = 0;
  for (int m = 0; m < T; ++m) {
    const double e = exp_(x[m] + static_cast<double>(line[m * stride]) - top);
    sum += e;
    const double moved = dir == nullptr ? dx[m] : dx[m] + static_cast<double>(dir[m * stride]);
    weighted += e == 0 ? 0.0 : e * moved;
  }
  out = top + log_(sum);
  mean = weighted / sum;
}

template <typename scalar_t>
__global__ void marginals_backward_kernel(MarginalsBackwardParams<scalar_t> p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warp = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t warps = (int64_t)gridDim.x * kWarpsPerBlock;
  const int T = p.num_tags;
  const int64_t L = p.max_len, LT = L * T;
  double* rows = p.forward_rows + warp * kNumForwardRows * LT;
  double *alpha = rows + kAlpha * LT, *a = rows + kTangent * LT, *mean = rows + kMean * LT, *lse = rows + kLineLse * LT;
  double* back = p.backward_rows + warp * kNumBackwardRows * T;
  double *beta = back + kBeta * T, *b = back + kBetaTangent * T, *v = back + kValue * T, *dv = back + kValueTangent * T;
  double *mu = back + kMu * T, *dmu = back + kMuTangent * T;
  double* pair = p.pair_sums + warp * T * T;
  const scalar_t* trans = p.transitions;

  for (int64_t s_index = warp; s_index < p.batch; s_index += warps) {
    const int64_t n = safe_length(p.lengths, s_index, L);
    if (n == 0) continue;
    const scalar_t* emit = p.emissions + s_index * LT;
    const scalar_t* V = p.grad == nullptr ? nullptr : p.grad + s_index * LT;
    const scalar_t* W = p.grad_counts == nullptr ? nullptr : p.grad_counts + s_index * T * T;
    scalar_t* out = p.grad_emissions + s_index * LT;

    // Forward: alpha and its tangent a, every row kept.
    for (int t = lane; t < T; t += kWarpSize) {
      alpha[t] = static_cast<double>(p.start[t]) + static_cast<double>(emit[t]);
      a[t] = V == nullptr ? 0.0 : static_cast<double>(V[t]);
    }
    __syncwarp();
    for (int64_t i = 1; i < n; ++i) {
      for (int t = lane; t < T; t += kWarpSize) {
        double line_lse, line_mean;
        tangent_line(alpha + (i - 1) * T, a + (i - 1) * T, trans + t, W == nullptr ? W : W + t, T, T, line_lse,
                     line_mean);
        alpha[i * T + t] = line_lse + static_cast<double>(emit[i * T + t]);
        a[i * T + t] = line_mean + (V == nullptr ? 0.0 : static_cast<double>(V[i * T + t]));
        mean[i * T + t] = line_mean;
        lse[i * T + t] = line_lse;
      }
      __syncwarp();
    }
    double last = neg_inf<double>();  // log Z = -inf (every sequence forbidden): all gradients 0
    for (int t = lane; t < T; t += kWarpSize) last = max_(last, alpha[(n - 1) * T + t] + static_cast<double>(p.end[t]));
    if (warp_max_of(last) == neg_inf<double>()) continue;

    // Backward: beta and its tangent b, one row at a time, with the outputs of position i.
    for (int t = lane; t < T; t += kWarpSize) {
      beta[t] = static_cast<double>(p.end[t]);
      b[t] = 0;
    }
    for (int64_t i = n - 1; i >= 0; --i) {
      const double *alpha_i = alpha + i * T, *a_i = a + i * T;
      // mu_i = softmax(alpha_i + beta_i), normalised per position; its maximum is finite.
      double top = neg_inf<double>();
      for (int t = lane; t < T; t += kWarpSize) top = max_(top, alpha_i[t] + beta[t]);
      top = warp_max_of(top);
      double total = 0;
      for (int t = lane; t < T; t += kWarpSize) total += exp_(alpha_i[t] + beta[t] - top);
      total = warp_sum(total);
      double z = 0;
      for (int t = lane; t < T; t += kWarpSize) {
        mu[t] = exp_(alpha_i[t] + beta[t] - top) / total;
        z += mu[t] == 0 ? 0.0 : mu[t] * (a_i[t] + b[t]);
      }
      z = warp_sum(z);
      for (int t = lane; t < T; t += kWarpSize) {
        dmu[t] = mu[t] == 0 ? 0.0 : mu[t] * (a_i[t] + b[t] - z);
        out[i * T + t] = static_cast<scalar_t>(dmu[t]);
        if (i == 0) p.start_sums[warp * T + t] += dmu[t];
        if (i == n - 1) p.end_sums[warp * T + t] += dmu[t];
      }
      if (i == 0) break;

      // Pairwise tangents of positions (i-1, i), column j by the lane that owns tag j:
      // P_i(s|j) = exp(alpha_{i-1}(s) + trans(s, j) - lse_i(j)), the forward's line.
      const double *alpha_prev = alpha + (i - 1) * T, *a_prev = a + (i - 1) * T;
      for (int j = lane; j < T; j += kWarpSize) {
        if (mu[j] == 0) continue;  // tag j unreachable at i: xi and its tangent are 0
        const double line_lse = lse[i * T + j];
        const double c0 = dmu[j] - mu[j] * mean[i * T + j];
        for (int s = 0; s < T; ++s) {
          const double x = alpha_prev[s] + static_cast<double>(trans[s * T + j]);
          if (x == neg_inf<double>()) continue;
          const double moved = W == nullptr ? a_prev[s] : a_prev[s] + static_cast<double>(W[s * T + j]);
          pair[s * T + j] += exp_(x - line_lse) * (mu[j] * moved + c0);
        }
      }

      // beta_{i-1}, b_{i-1} from v = emit_i + beta_i and dv = V_i + b_i.
      for (int t = lane; t < T; t += kWarpSize) {
        v[t] = static_cast<double>(emit[i * T + t]) + beta[t];
        dv[t] = (V == nullptr ? 0.0 : static_cast<double>(V[i * T + t])) + b[t];
      }
      __syncwarp();
      for (int s = lane; s < T; s += kWarpSize) {
        tangent_line(v, dv, trans + (int64_t)s * T, W == nullptr ? W : W + (int64_t)s * T, 1, T, beta[s], b[s]);
      }
      __syncwarp();
    }
  }
}

// The vector-Jacobian product of the marginals with grad_marginals (B, L, T) or of the expected
// transition counts with grad_counts (B, T, T): the one given is the direction, the other is
// undefined (a zero direction).
std::tuple<Tensor, Tensor, Tensor, Tensor> tangent_backward_cuda(
    const Tensor& grad_marginals_in, const Tensor& grad_counts_in, const Tensor& emissions,
    const Tensor& transitions, const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& c, Status& status) {
    const int64_t B = c.emissions.size(0), L = c.emissions.size(1), T = c.emissions.size(2);
    Tensor grad, grad_counts;
    if (grad_marginals_in.defined()) {
      grad = as_contiguous(grad_marginals_in);
      check_argument_like(grad, "grad_marginals", "(batch, seq_len, num_tags)", c.emissions.sizes(), c.emissions,
                          "emissions");
    }
    if (grad_counts_in.defined()) {
      grad_counts = as_contiguous(grad_counts_in);
      check_argument_like(grad_counts, "grad_counts", "(batch, num_tags, num_tags)", {B, T, T}, c.emissions,
                          "emissions");
    }
    launch_check_emissions(c.emissions, c.lengths, status);
    auto grad_emissions = zeros_like(c.emissions);
    const auto doubles = options_of(c.emissions).dtype(kDouble);
    Tensor pair_sums, start_sums, end_sums;  // (warps, T, T), (warps, T), (warps, T)
    CRFKIT_DISPATCH_FLOATING_TYPES(c.emissions.scalar_type(), "crfkit_marginals_backward_cuda", [&] {
      const auto kernel = marginals_backward_kernel<scalar_t>;
      constexpr int threads = kWarpsPerBlock * kWarpSize;
      // Warps: one per sentence, at most what the device holds at once and what
      // kWorkspaceBudget allows.
      int blocks_per_multiprocessor = 0;
      CRFKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_multiprocessor, kernel, threads, 0));
      const int64_t resident = std::max<int64_t>(1, (int64_t)blocks_per_multiprocessor * kWarpsPerBlock *
                                                        current_device_attribute(cudaDevAttrMultiProcessorCount));
      const int64_t per_warp_bytes = std::max<int64_t>(
          1, (kNumForwardRows * L * T + kNumBackwardRows * T + T * T + 2 * T) * (int64_t)sizeof(double));
      const int64_t wanted = std::min({B, resident, std::max<int64_t>(1, kWorkspaceBudget / per_warp_bytes)});
      const int64_t blocks = std::max<int64_t>(1, (wanted + kWarpsPerBlock - 1) / kWarpsPerBlock);
      const int64_t warps = blocks * kWarpsPerBlock;
      pair_sums = zeros({warps, T, T}, doubles);
      start_sums = zeros({warps, T}, doubles);
      end_sums = zeros({warps, T}, doubles);
      if (B == 0 || L == 0) return;
      auto forward_rows = empty({warps, kNumForwardRows, L, T}, doubles);
      auto backward_rows = empty({warps, kNumBackwardRows, T}, doubles);
      MarginalsBackwardParams<scalar_t> p;
      set_crf_arguments<scalar_t>(p, c, status);
      p.grad = grad.defined() ? grad.mutable_data_ptr<scalar_t>() : nullptr;
      p.grad_counts = grad_counts.defined() ? grad_counts.mutable_data_ptr<scalar_t>() : nullptr;
      p.grad_emissions = grad_emissions.mutable_data_ptr<scalar_t>();
      p.forward_rows = forward_rows.mutable_data_ptr<double>();
      p.backward_rows = backward_rows.mutable_data_ptr<double>();
      p.pair_sums = pair_sums.mutable_data_ptr<double>();
      p.start_sums = start_sums.mutable_data_ptr<double>();
      p.end_sums = end_sums.mutable_data_ptr<double>();
      kernel<<<blocks, threads, 0, current_stream()>>>(p);
      CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
    });
    const auto dtype = c.emissions.scalar_type();
    return std::make_tuple(grad_emissions, to_dtype(sum_first_dim(pair_sums), dtype),
                           to_dtype(sum_first_dim(start_sums), dtype), to_dtype(sum_first_dim(end_sums), dtype));
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> marginals_backward_cuda(
    const Tensor& grad_marginals, const Tensor& emissions, const Tensor& transitions,
    const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return tangent_backward_cuda(grad_marginals, Tensor(), emissions, transitions, lengths, start, end);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> expected_transition_counts_backward_cuda(
    const Tensor& grad_counts, const Tensor& emissions, const Tensor& transitions,
    const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return tangent_backward_cuda(Tensor(), grad_counts, emissions, transitions, lengths, start, end);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("marginals_backward", TORCH_BOX(&marginals_backward_cuda));
  m.impl("expected_transition_counts_backward", TORCH_BOX(&expected_transition_counts_backward_cuda));
}

}  // namespace cuda
}  // namespace crfkit
