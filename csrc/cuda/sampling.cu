// CUDA kernels: exact sampling of tag sequences from a linear-chain CRF, WITH replacement (forward
// filtering, backward sampling) and WITHOUT replacement (stochastic beam search). The algorithms,
// the noise contract (noise (L, B, n, T) standard Gumbels drawn by the caller, noise[k] the k-th
// step of the right-to-left sweep), the arithmetic (double throughout, the PyTorch path's
// association, ties to the smaller tag or code) and the outputs (paths (B, n, L) int64, -1 where a
// row holds no sequence) are those of csrc/cpu/sampling.cpp, whose top comment explains them; this
// file says only how the GPU lays the work out. Transitions shared (T, T) with start, end (T,), or
// per example (B, Lt, T, T) with start, end (B, T) (csrc/cpu/per_example.h).
//
// Status: compiled for sm_80 / sm_90 and checked against the CPU kernels in the CPU emulator
// (tests/test_cuda.py); not yet run or timed on a GPU, so this is the plain layout below, untuned.
//
// One warp per sentence (grid-stride over sentences by warp), its rows in a per-warp slice of a
// global workspace (cached in L1 / L2), __syncwarp wherever a lane reads what another wrote.
// - Forward: lane t (and t + 32, ...) computes alpha_i[t] = logsumexp_s(alpha_{i-1}[s] +
//   trans[s, t]) + emit_i[t] in double as max + log(sum exp(x - max)); the CPU kernel scales
//   exponentials by maxima (log_space.h), so the two agree to an ulp or two of double and the
//   samples agree unless two perturbed values fall that close (never seen in the tests).
// - With replacement: lane j takes rows j, j + 32, ... and walks right to left (no barrier).
// - Without replacement, per position: the lanes score the live beams' children c = j * T + s
//   (lane c mod 32 owns c), then each beam's largest g, then the children's keys (the CPU
//   kernel's formula, operation for operation); then n rounds of a warp argmax (the larger key,
//   then the smaller code: the CPU kernel's ranks_before) take the next beams, best first. A lane
//   scans only the children it owns, so taking one needs no barrier. No pruning: O(n T) keys per
//   position where the CPU kernel computes about O(n), and O(n^2 T / 32) for the rounds.
#include "common.cuh"

namespace crfkit {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
// Bytes of per-warp workspace one call may allocate; fewer warps (each taking more sentences)
// beyond it.
constexpr int64_t kWorkspaceBudget = int64_t(256) << 20;
constexpr double kLog2 = 0.6931471805599453;  // crfkit/sampling.py's _log1mexp branch point

template <typename scalar_t>
struct SampleParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T), or per example (B, Lt, T, T)
  const scalar_t* start;        // (T,), or per example (B, T)
  const scalar_t* end;          // (T,), or per example (B, T)
  // Where sentence b's parameters start: 0 for shared ones; Lt * T * T, T * T for Lt = L (else
  // 0) and T for per-example ones.
  int64_t trans_batch = 0, trans_step = 0, parameter_stride = 0;
  const int64_t* lengths;       // (B,)
  const scalar_t* noise;        // (L, B, n, T)
  long long* status;
  int64_t batch = 0, max_len = 0, num_samples = 0;
  int num_tags = 0;
  int64_t* paths;  // (B, n, L), every entry written
  // Per-warp workspace, `warps` slices each:
  double* alpha;        // (L, T)
  double* into;         // (L, T): alpha_i before its emission (without replacement only)
  double* beam_rows;    // (kNumBeamRows, n): without replacement only
  int64_t* beam_tags;   // (2, n): each beam's tag at the position to its right, two generations
  double* child_rows;   // (kNumChildRows, n T)
  int32_t* trace;       // (2, L, n): parent, chosen
};

// The beams of two generations (the live one is read while the next is written) and each live
// beam's largest perturbed child value.
enum BeamRow { kKey0, kKey1, kPhi0, kPhi1, kBeamMax, kNumBeamRows };
enum ChildRow { kChildPhi, kChildG, kChildKey, kNumChildRows };

__device__ __forceinline__ bool is_non_finite(double v) { return v != v || v == CUDART_INF || v == -CUDART_INF; }

// Sentence b's parameters: start, end (T,) and, for position i >= 1, the (T, T) matrix of its
// y_{i-1} -> y_i transitions.
template <typename scalar_t>
struct Parameters {
  const scalar_t* trans;
  int64_t trans_step;
  const scalar_t* start;
  const scalar_t* end;
  __device__ const scalar_t* trans_at(int64_t i) const { return trans + i * trans_step; }
};

template <typename scalar_t>
__device__ __forceinline__ Parameters<scalar_t> parameters_of(const SampleParams<scalar_t>& p, int64_t b) {
  return {p.transitions + b * p.trans_batch, p.trans_step, p.start + b * p.parameter_stride,
          p.end + b * p.parameter_stride};
}

// Noise block of rows 0 .. n of sentence b at position i: (n, T).
template <typename scalar_t>
__device__ __forceinline__ const scalar_t* noise_at(const SampleParams<scalar_t>& p, int64_t b, int64_t i) {
  return p.noise + ((p.max_len - 1 - i) * p.batch + b) * p.num_samples * p.num_tags;
}

// Whether sentence b (length m) can be sampled: reports NaN / +inf emissions (kBadEmissions) or
// non-finite noise (kBadNoise) within its length and returns false for them. Warp-uniform.
template <typename scalar_t>
__device__ bool sentence_ok(const SampleParams<scalar_t>& p, int64_t b, int64_t m, int lane) {
  const int64_t T = p.num_tags, per_position = p.num_samples * T;
  const scalar_t* emit = p.emissions + b * p.max_len * T;
  int bad_emissions = 0, bad_noise = 0;
  for (int64_t k = lane; k < m * T; k += kWarpSize) bad_emissions |= is_nan_or_pos_inf(emit[k]) ? 1 : 0;
  for (int64_t i = 0; i < m; ++i) {
    const scalar_t* g = noise_at(p, b, i);
    for (int64_t k = lane; k < per_position; k += kWarpSize) {
      bad_noise |= is_non_finite(static_cast<double>(g[k])) ? 1 : 0;
    }
  }
  bad_emissions = group_max(bad_emissions, kWarpSize);
  bad_noise = group_max(bad_noise, kWarpSize);
  if (lane == 0 && bad_emissions) report(p.status, kBadEmissions, b);
  if (lane == 0 && !bad_emissions && bad_noise) report(p.status, kBadNoise, b);
  return !bad_emissions && !bad_noise;
}

// alpha (m, T) of sentence b in double and, where `into` is not null, into[i] for 1 <= i < m (the
// logsumexp before the emission: alpha_i = into_i + emit_i, as the CPU kernel's record_into).
template <typename scalar_t>
__device__ void forward_scores(const SampleParams<scalar_t>& p, const Parameters<scalar_t>& x, int64_t b, int64_t m,
                               double* alpha, double* into, int lane) {
  const int T = p.num_tags;
  const scalar_t* emit = p.emissions + b * p.max_len * T;
  for (int t = lane; t < T; t += kWarpSize) alpha[t] = static_cast<double>(x.start[t]) + static_cast<double>(emit[t]);
  __syncwarp();
  for (int64_t i = 1; i < m; ++i) {
    const double* prev = alpha + (i - 1) * T;
    const scalar_t* trans = x.trans_at(i);
    for (int t = lane; t < T; t += kWarpSize) {
      double top = neg_inf<double>();
      for (int s = 0; s < T; ++s) top = max_(top, prev[s] + static_cast<double>(trans[s * T + t]));
      double lse = top;
      if (top > neg_inf<double>()) {
        double sum = 0;
        for (int s = 0; s < T; ++s) sum += exp_((prev[s] + static_cast<double>(trans[s * T + t])) - top);
        lse = log_(sum) + top;
      }
      if (into != nullptr) into[i * T + t] = lse;
      alpha[i * T + t] = lse + static_cast<double>(emit[i * T + t]);
    }
    __syncwarp();
  }
}

// Rows of sentence b (length m >= 1) with replacement: lane j draws rows j, j + 32, ...
template <typename scalar_t>
__device__ void sample_rows(const SampleParams<scalar_t>& p, const Parameters<scalar_t>& x, int64_t b, int64_t m,
                            const double* alpha, int64_t* out, int lane) {
  const int T = p.num_tags;
  const int64_t L = p.max_len;
  for (int64_t j = lane; j < p.num_samples; j += kWarpSize) {
    int64_t* row = out + j * L;
    int tag = -1;  // the tag to the right; -1: the end scores
    for (int64_t i = m - 1; i >= 0; --i) {
      const double* a = alpha + i * T;
      const scalar_t* g = noise_at(p, b, i) + j * T;
      double best = neg_inf<double>();
      int chosen = 0;
      for (int s = 0; s < T; ++s) {
        const double right = static_cast<double>(tag < 0 ? x.end[s] : x.trans_at(i + 1)[s * T + tag]);
        const double v = (a[s] + right) + static_cast<double>(g[s]);
        if (v > best) {
          best = v;
          chosen = s;
        }
      }
      tag = chosen;
      row[i] = tag;
    }
  }
}

// The n distinct rows of sentence b (length m >= 1) without replacement, log Z = log_z finite.
template <typename scalar_t>
__device__ void sample_distinct_rows(const SampleParams<scalar_t>& p, const Parameters<scalar_t>& x, int64_t b,
                                     int64_t m, double log_z,
                                     const double* alpha, const double* into, double* beam_rows, int64_t* beam_tags,
                                     double* child_rows, int32_t* trace, int64_t* out, int lane) {
  const int T = p.num_tags;
  const int64_t L = p.max_len, n = p.num_samples;
  double* child_phi = child_rows + kChildPhi * n * T;
  double* child_g = child_rows + kChildG * n * T;
  double* child_key = child_rows + kChildKey * n * T;
  double* beam_max = beam_rows + kBeamMax * n;
  int32_t* parent = trace;
  int32_t* chosen = trace + L * n;
  // The root: the empty suffix, log-probability 0, perturbed value 0.
  if (lane == 0) {
    beam_rows[kKey0 * n] = 0;
    beam_rows[kPhi0 * n] = 0;
    beam_tags[0] = 0;
  }
  __syncwarp();
  int64_t live = 1;
  int generation = 0;
  for (int64_t i = m - 1; i >= 0; --i) {
    const double* a = alpha + i * T;
    const scalar_t* noise = noise_at(p, b, i);
    const double* key = beam_rows + (generation ? kKey1 : kKey0) * n;
    const double* phi = beam_rows + (generation ? kPhi1 : kPhi0) * n;
    const int64_t* tag = beam_tags + generation * n;
    double* next_key = beam_rows + (generation ? kKey0 : kKey1) * n;
    double* next_phi = beam_rows + (generation ? kPhi0 : kPhi1) * n;
    int64_t* next_tag = beam_tags + (1 - generation) * n;
    const int64_t children = live * T;
    // Every live beam's children: log-probabilities phi_c and unconditioned perturbed values g_c.
    for (int64_t c = lane; c < children; c += kWarpSize) {
      const int64_t j = c / T;
      const int s = static_cast<int>(c - j * T);
      double right, norm;
      if (i == m - 1) {
        right = static_cast<double>(x.end[s]);
        norm = log_z;
      } else {
        const int64_t t = tag[j];
        right = static_cast<double>(x.trans_at(i + 1)[s * T + t]);
        norm = into[(i + 1) * T + t];
      }
      double phi_c = neg_inf<double>(), g_c = neg_inf<double>();
      if (norm > neg_inf<double>()) {  // (always, for a live beam: its tag has a prefix)
        phi_c = phi[j] + ((a[s] + right) - norm);
        g_c = phi_c + static_cast<double>(noise[j * T + s]);
      }
      child_phi[c] = phi_c;
      child_g[c] = g_c;
    }
    __syncwarp();
    for (int64_t j = lane; j < live; j += kWarpSize) {
      double z = neg_inf<double>();
      for (int s = 0; s < T; ++s) z = max_(z, child_g[j * T + s]);
      beam_max[j] = z;
    }
    __syncwarp();
    // Keys (crfkit/sampling.py's _conditional_gumbels, in its arithmetic); -inf marks a child that
    // cannot be taken (impossible, or taken already). Each lane's best own child, ascending codes.
    double best_key = neg_inf<double>();
    int best_code = std::numeric_limits<int>::max();
    for (int64_t c = lane; c < children; c += kWarpSize) {
      const int64_t j = c / T;
      const double g = child_g[c], z = beam_max[j], key_j = key[j];
      double key_c;
      if (!(g > neg_inf<double>())) {
        key_c = neg_inf<double>();
      } else if (g == z) {
        key_c = key_j;
      } else {
        const double d = g - z;
        const double log1mexp = d > -kLog2 ? ::log(-::expm1(d)) : ::log1p(-::exp(d));
        const double v = (key_j - g) + log1mexp;
        const double softplus = v > 40.0 ? v : ::log1p(::exp(v));
        key_c = key_j - softplus;
      }
      child_key[c] = key_c;
      if (key_c > best_key) {
        best_key = key_c;
        best_code = static_cast<int>(c);
      }
    }
    // The next beams, best first; fewer than n when fewer children are possible.
    int64_t next_live = 0;
    for (int64_t r = 0; r < n; ++r) {
      double winner_key = best_key;
      int winner = best_code;
      group_argmax(winner_key, winner, kWarpSize);
      if (!(winner_key > neg_inf<double>())) break;  // warp-uniform
      const int64_t j = winner / T;
      const int s = winner - static_cast<int>(j) * T;
      if (lane == 0) {
        next_key[r] = winner_key;
        next_phi[r] = child_phi[winner];
        next_tag[r] = s;
        parent[i * n + r] = static_cast<int32_t>(j);
        chosen[i * n + r] = s;
      }
      ++next_live;
      if (winner % kWarpSize == lane) {  // the owner takes it and finds its next best
        child_key[winner] = neg_inf<double>();
        best_key = neg_inf<double>();
        best_code = std::numeric_limits<int>::max();
        for (int64_t c = lane; c < children; c += kWarpSize) {
          if (child_key[c] > best_key) {
            best_key = child_key[c];
            best_code = static_cast<int>(c);
          }
        }
      }
    }
    __syncwarp();
    live = next_live;
    generation = 1 - generation;
  }
  // Row k: the final beam k traced back from position 0 to m - 1.
  for (int64_t k = lane; k < live; k += kWarpSize) {
    int64_t beam = k;
    for (int64_t i = 0; i < m; ++i) {
      out[k * L + i] = chosen[i * n + beam];
      beam = parent[i * n + beam];
    }
  }
}

template <typename scalar_t, bool kWithReplacement>
__global__ void sample_kernel(SampleParams<scalar_t> p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warp = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t warps = (int64_t)gridDim.x * kWarpsPerBlock;
  const int T = p.num_tags;
  const int64_t L = p.max_len, n = p.num_samples;
  double* alpha = p.alpha + warp * L * T;
  double* into = kWithReplacement ? nullptr : p.into + warp * L * T;
  for (int64_t b = warp; b < p.batch; b += warps) {
    __syncwarp();  // the previous sentence's reads of the workspace and of `out` are done
    int64_t* out = p.paths + b * n * L;
    for (int64_t k = lane; k < n * L; k += kWarpSize) out[k] = -1;
    __syncwarp();  // the -1s before the rows' tags, which other lanes may write
    const int64_t m = safe_length(p.lengths, b, L);
    if (!sentence_ok(p, b, m, lane) || m == 0) continue;
    const Parameters<scalar_t> x = parameters_of(p, b);
    forward_scores(p, x, b, m, alpha, into, lane);
    // log Z as crfkit.reference.safe_logsumexp computes it, by every lane (warp-uniform).
    const double* last = alpha + (m - 1) * T;
    double top = neg_inf<double>();
    for (int t = 0; t < T; ++t) top = max_(top, last[t] + static_cast<double>(x.end[t]));
    if (top == neg_inf<double>()) continue;  // every sequence forbidden: no row holds one
    if (kWithReplacement) {
      sample_rows(p, x, b, m, alpha, out, lane);
    } else {
      double sum = 0;
      for (int t = 0; t < T; ++t) sum += exp_((last[t] + static_cast<double>(x.end[t])) - top);
      const double log_z = log_(sum) + top;
      sample_distinct_rows(p, x, b, m, log_z, alpha, into, p.beam_rows + warp * kNumBeamRows * n,
                           p.beam_tags + warp * 2 * n, p.child_rows + warp * kNumChildRows * n * T,
                           p.trace + warp * 2 * L * n, out, lane);
    }
  }
}

// The body of both ops: paths (B, n, L) for noise (L, B, n, T).
template <bool kWithReplacement>
Tensor sample_cuda(const Tensor& emissions, const Tensor& transitions, const Tensor& noise_in, const Tensor& lengths,
                   const Tensor& start, const Tensor& end) {
  const bool per_example = transitions.dim() == 4;
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    const Tensor noise = as_contiguous(noise_in);
    check_noise_argument(noise, a.emissions);
    const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2), n = noise.size(2);
    CRFKIT_CHECK_VALUE(n * T < std::numeric_limits<int>::max(), "crfkit: the CUDA sampler takes num_samples * num_tags below 2^31, got ",
                       n, " * ", T);
    Tensor paths = empty({B, n, L}, options_of(a.lengths));
    if (B == 0 || L == 0 || n == 0) return paths;
    const auto doubles = options_of(a.emissions).dtype(kDouble);
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_sample_cuda", [&] {
      const auto kernel = sample_kernel<scalar_t, kWithReplacement>;
      constexpr int threads = kWarpsPerBlock * kWarpSize;
      // Warps: one per sentence, at most what the device holds at once and what
      // kWorkspaceBudget allows.
      int blocks_per_multiprocessor = 0;
      CRFKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_multiprocessor, kernel, threads, 0));
      const int64_t resident = std::max<int64_t>(1, (int64_t)blocks_per_multiprocessor * kWarpsPerBlock *
                                                        current_device_attribute(cudaDevAttrMultiProcessorCount));
      const int64_t rows = kWithReplacement ? L * T
                                            : 2 * L * T + kNumBeamRows * n + kNumChildRows * n * T + 2 * n + L * n;
      const int64_t per_warp_bytes = std::max<int64_t>(1, rows * (int64_t)sizeof(double));
      const int64_t wanted = std::min({B, resident, std::max<int64_t>(1, kWorkspaceBudget / per_warp_bytes)});
      const int64_t blocks = std::max<int64_t>(1, (wanted + kWarpsPerBlock - 1) / kWarpsPerBlock);
      const int64_t warps = blocks * kWarpsPerBlock;
      SampleParams<scalar_t> p;
      set_crf_arguments<scalar_t>(p, a, status);
      if (a.transitions.dim() == 4) {
        const int64_t Lt = a.transitions.size(1);
        p.trans_batch = Lt * T * T;
        p.trans_step = Lt == 1 ? 0 : T * T;
        p.parameter_stride = T;
      }
      p.noise = noise.mutable_data_ptr<scalar_t>();
      p.num_samples = n;
      p.paths = paths.mutable_data_ptr<int64_t>();
      Tensor alpha = empty({warps, L, T}, doubles), into, beam_rows, beam_tags, child_rows, trace;
      p.alpha = alpha.mutable_data_ptr<double>();
      if (!kWithReplacement) {
        into = empty({warps, L, T}, doubles);
        beam_rows = empty({warps, kNumBeamRows, n}, doubles);
        beam_tags = empty({warps, 2, n}, options_of(a.lengths));
        child_rows = empty({warps, kNumChildRows, n * T}, doubles);
        trace = empty({warps, 2, L, n}, options_of(a.lengths).dtype(kInt));
        p.into = into.mutable_data_ptr<double>();
        p.beam_rows = beam_rows.mutable_data_ptr<double>();
        p.beam_tags = beam_tags.mutable_data_ptr<int64_t>();
        p.child_rows = child_rows.mutable_data_ptr<double>();
        p.trace = trace.mutable_data_ptr<int32_t>();
      }
      kernel<<<blocks, threads, 0, current_stream()>>>(p);
      CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return paths;
  }, per_example);
}

// paths (B, n, L) int64 for noise (L, B, n, T): see csrc/cpu/sampling.cpp.
Tensor sample_with_replacement_cuda(const Tensor& emissions, const Tensor& transitions, const Tensor& noise,
                                    const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return sample_cuda<true>(emissions, transitions, noise, lengths, start, end);
}

// paths (B, n, L) int64, n distinct rows per sentence, for noise (L, B, n, T).
Tensor sample_without_replacement_cuda(const Tensor& emissions, const Tensor& transitions, const Tensor& noise,
                                       const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return sample_cuda<false>(emissions, transitions, noise, lengths, start, end);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("sample_with_replacement", TORCH_BOX(&sample_with_replacement_cuda));
  m.impl("sample_without_replacement", TORCH_BOX(&sample_without_replacement_cuda));
}

}  // namespace cuda
}  // namespace crfkit
