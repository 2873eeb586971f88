// CUDA kernels for per-example transitions: transitions (B, Lt, T, T) with Lt = 1 (one matrix per
// sentence) or Lt = L (one per position: transitions[b, i, s, t] scores y_{i-1} = s -> y_i = t;
// transitions[:, 0] is never read), start and end (B, T). The counterparts of
// csrc/cpu/per_example.cpp, with its arithmetic, conventions and outputs (its top comment explains
// them): the forward-backward in double, normalised per position; Viterbi and k-best in scalar_t
// with the 2-D kernels' accumulation order and tie rule, so that they decode exactly as the CPU
// does. Each op's CUDA entry point sends 4-D transitions here (per_example.cuh).
//
// Status: compiled for sm_80 / sm_90 and checked against the CPU kernels in the CPU emulator
// (tests/test_cuda.py); not yet run or timed on a GPU, so this is the plain layout below, untuned.
//
// Why plain kernels next to the tuned ones: those stage the one shared (T, T) matrix in shared
// memory or registers for a block that walks many sentences; here every sentence (or position)
// has its own matrix, read from global memory (cached in L1 / L2) where it is used.
// One warp per sentence (grid-stride over sentences by warp), lane l owning the tags t = l, l + 32,
// ...; the warp's rows in its slice of a global workspace; __syncwarp wherever a lane reads what
// another wrote.
#include "common.cuh"
#include "per_example.cuh"
#include "viterbi_common.cuh"  // check_sizes, num_sequences_capped

#include "../kbest_merge.h"

namespace crfkit {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
// Bytes of per-warp workspace one call may allocate; fewer warps (each taking more sentences)
// beyond it.
constexpr int64_t kWorkspaceBudget = int64_t(256) << 20;

// Sentence b's scores: emit (L, T), start / end (T,) and, for position i >= 1, the (T, T) matrix
// of its y_{i-1} -> y_i transitions.
template <typename scalar_t>
struct Sentence {
  const scalar_t* emit;
  const scalar_t* trans;  // (Lt, T, T)
  int64_t trans_step;     // 0 for Lt = 1, T * T for Lt = L
  const scalar_t* start;
  const scalar_t* end;
  __device__ const scalar_t* trans_at(int64_t i) const { return trans + i * trans_step; }
};

// What every kernel here reads (set_crf_arguments fills the first block).
template <typename scalar_t>
struct PerExampleArgs {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (B, Lt, T, T)
  const scalar_t* start;        // (B, T)
  const scalar_t* end;          // (B, T)
  const int64_t* lengths;       // (B,)
  long long* status;
  int64_t batch = 0, max_len = 0;
  int num_tags = 0;
  int64_t trans_positions = 1;  // Lt
  InputChecks<scalar_t> checks;  // run first by every thread

  __device__ Sentence<scalar_t> sentence(int64_t b) const {
    const int64_t T = num_tags;
    return {emissions + b * max_len * T, transitions + b * trans_positions * T * T,
            trans_positions == 1 ? 0 : T * T, start + b * T, end + b * T};
  }
};

// Warp `warp` of the launch and the count of warps.
__device__ __forceinline__ int64_t warp_index() { return (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize; }
__device__ __forceinline__ int64_t warp_count() { return (int64_t)gridDim.x * kWarpsPerBlock; }

// Whether sentence b's emissions within its length n are free of NaN / +inf; reports
// kBadEmissions otherwise. Warp-uniform.
template <typename scalar_t>
__device__ bool emissions_ok(const PerExampleArgs<scalar_t>& p, int64_t b, int64_t n, int lane) {
  const scalar_t* emit = p.emissions + b * p.max_len * p.num_tags;
  int bad = 0;
  for (int64_t k = lane; k < n * p.num_tags; k += kWarpSize) bad |= is_nan_or_pos_inf(emit[k]) ? 1 : 0;
  bad = group_max(bad, kWarpSize);
  if (bad && lane == 0) report(p.status, kBadEmissions, b);
  return !bad;
}

// The shift of a logsumexp: the maximum, or 0 for a line of -inf (whose terms then are exp(-inf) =
// 0 and whose logsumexp is log 0 = -inf, never NaN), as the CPU kernel's.
__device__ __forceinline__ double shift_of(double top) { return top == neg_inf<double>() ? 0.0 : top; }

// ---- forward-backward ---------------------------------------------------------------------------

// Where the forward-backward writes (null: not wanted); the outputs are zero-filled before.
template <typename scalar_t>
struct FbOutputs {
  const scalar_t* grad_log_z = nullptr;  // (B,); null: 1 for every sentence
  scalar_t* log_z = nullptr;             // (B,)
  scalar_t* marginals = nullptr;         // (B, L, T)
  scalar_t* pairs = nullptr;             // (B, Lt, T, T) per position, else (B, T, T) summed
  bool pairs_per_position = false;
  scalar_t* start = nullptr;  // (B, T): the marginals at position 0
  scalar_t* end = nullptr;    // (B, T): at position n - 1
};

// Doubles of one warp's workspace: alpha (L, T), beta and its successor (2, T), v (T), and the
// pairwise marginals' sum (T, T) where they are summed.
__host__ __device__ inline int64_t fb_workspace_doubles(int64_t L, int64_t T, bool summed_pairs) {
  return L * T + 3 * T + (summed_pairs ? T * T : 0);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) forward_backward_kernel(PerExampleArgs<scalar_t> p,
                                                                    FbOutputs<scalar_t> out, double* workspace) {
  check_inputs(p.checks);
  const int lane = threadIdx.x % kWarpSize;
  const int T = p.num_tags;
  const int64_t L = p.max_len, TT = (int64_t)T * T;
  const bool summed_pairs = out.pairs != nullptr && !out.pairs_per_position;
  const bool wants_backward = out.marginals || out.pairs || out.start || out.end;
  const int64_t pairs_rows = out.pairs_per_position ? p.trans_positions : 1;
  double* alpha = workspace + warp_index() * fb_workspace_doubles(L, T, summed_pairs);
  double* beta = alpha + L * T;
  double* beta_prev = beta + T;
  double* v = beta_prev + T;
  double* pair_sum = v + T;  // (T, T) where summed_pairs
  for (int64_t b = warp_index(); b < p.batch; b += warp_count()) {
    __syncwarp();  // the previous sentence's reads of the workspace are done
    const int64_t n = safe_length(p.lengths, b, L);
    if (!emissions_ok(p, b, n, lane)) continue;
    if (n == 0) {  // the empty sequence: log Z = 0, nothing to differentiate
      if (out.log_z != nullptr && lane == 0) out.log_z[b] = 0;
      continue;
    }
    const Sentence<scalar_t> x = p.sentence(b);
    // alpha_0 = start + emit_0, alpha_i[t] = logsumexp_s(alpha_{i-1}[s] + trans_i[s, t]) + emit_i[t]
    for (int t = lane; t < T; t += kWarpSize) alpha[t] = static_cast<double>(x.start[t]) + static_cast<double>(x.emit[t]);
    __syncwarp();
    for (int64_t i = 1; i < n; ++i) {
      const double* prev = alpha + (i - 1) * T;
      const scalar_t* trans = x.trans_at(i);
      for (int t = lane; t < T; t += kWarpSize) {
        double top = neg_inf<double>();
        for (int s = 0; s < T; ++s) top = max_(top, prev[s] + static_cast<double>(trans[s * T + t]));
        const double shift = shift_of(top);
        double sum = 0;
        for (int s = 0; s < T; ++s) sum += exp_((prev[s] + static_cast<double>(trans[s * T + t])) - shift);
        alpha[i * T + t] = (shift + log_(sum)) + static_cast<double>(x.emit[i * T + t]);
      }
      __syncwarp();
    }
    // log Z = logsumexp_t(alpha_{n-1}[t] + end[t]), warp-wide (every lane gets the same value).
    const double* last = alpha + (n - 1) * T;
    double top = neg_inf<double>();
    for (int t = lane; t < T; t += kWarpSize) top = max_(top, last[t] + static_cast<double>(x.end[t]));
    top = shift_of(group_max(top, kWarpSize));
    double sum = 0;
    for (int t = lane; t < T; t += kWarpSize) sum += exp_((last[t] + static_cast<double>(x.end[t])) - top);
    const double log_z = top + log_(group_sum(sum, kWarpSize));
    if (out.log_z != nullptr && lane == 0) out.log_z[b] = static_cast<scalar_t>(log_z);
    const double g = out.grad_log_z != nullptr ? static_cast<double>(out.grad_log_z[b]) : 1.0;
    // Every sequence forbidden (log Z = -inf) or no upstream gradient: the zeros stay.
    if (!wants_backward || log_z == neg_inf<double>() || g == 0) continue;

    // Backward: beta_{n-1} = end, beta_{i-1}[s] = logsumexp_t(trans_i[s, t] + v_i[t]) with
    // v_i = emit_i + beta_i; the marginals softmax_t(alpha_i + beta_i) and the pairwise marginals
    // softmax_{s,t}(alpha_{i-1}[s] + (trans_i[s, t] + v_i[t])), from the last position.
    scalar_t* marginals = out.marginals != nullptr ? out.marginals + b * L * T : nullptr;
    scalar_t* pairs = out.pairs != nullptr ? out.pairs + b * pairs_rows * TT : nullptr;
    for (int t = lane; t < T; t += kWarpSize) beta[t] = static_cast<double>(x.end[t]);
    if (summed_pairs) {
      for (int64_t k = lane; k < TT; k += kWarpSize) pair_sum[k] = 0;
    }
    for (int64_t i = n - 1; i >= 0; --i) {
      const double* alpha_i = alpha + i * T;
      double m = neg_inf<double>();
      for (int t = lane; t < T; t += kWarpSize) m = max_(m, alpha_i[t] + beta[t]);
      m = group_max(m, kWarpSize);
      if (m > neg_inf<double>()) {  // (always, for a finite log Z)
        double total = 0;
        for (int t = lane; t < T; t += kWarpSize) total += exp_((alpha_i[t] + beta[t]) - m);
        total = group_sum(total, kWarpSize);
        for (int t = lane; t < T; t += kWarpSize) {
          const auto scaled = static_cast<scalar_t>(g * (exp_((alpha_i[t] + beta[t]) - m) / total));
          if (marginals != nullptr) marginals[i * T + t] = scaled;
          if (out.start != nullptr && i == 0) out.start[b * T + t] = scaled;
          if (out.end != nullptr && i == n - 1) out.end[b * T + t] = scaled;
        }
      }
      if (i == 0) break;
      const scalar_t* trans = x.trans_at(i);
      for (int t = lane; t < T; t += kWarpSize) v[t] = static_cast<double>(x.emit[i * T + t]) + beta[t];
      __syncwarp();  // v whole
      if (pairs != nullptr) {
        const double* alpha_prev = alpha_i - T;
        double pm = neg_inf<double>();
        for (int64_t k = lane; k < TT; k += kWarpSize) {
          pm = max_(pm, alpha_prev[k / T] + (static_cast<double>(trans[k]) + v[k % T]));
        }
        pm = shift_of(group_max(pm, kWarpSize));
        double ptotal = 0;
        for (int64_t k = lane; k < TT; k += kWarpSize) {
          ptotal += exp_((alpha_prev[k / T] + (static_cast<double>(trans[k]) + v[k % T])) - pm);
        }
        ptotal = group_sum(ptotal, kWarpSize);
        for (int64_t k = lane; k < TT; k += kWarpSize) {
          const double pair = exp_((alpha_prev[k / T] + (static_cast<double>(trans[k]) + v[k % T])) - pm) / ptotal;
          if (summed_pairs) {
            pair_sum[k] += pair;  // lane k mod 32 owns entry k: no race
          } else {
            pairs[i * TT + k] = static_cast<scalar_t>(g * pair);
          }
        }
      }
      for (int s = lane; s < T; s += kWarpSize) {
        const scalar_t* row = trans + s * T;
        double row_top = neg_inf<double>();
        for (int t = 0; t < T; ++t) row_top = max_(row_top, static_cast<double>(row[t]) + v[t]);
        const double shift = shift_of(row_top);
        double row_sum = 0;
        for (int t = 0; t < T; ++t) row_sum += exp_((static_cast<double>(row[t]) + v[t]) - shift);
        beta_prev[s] = shift + log_(row_sum);
      }
      __syncwarp();  // v read by every lane before the next position writes it
      double* swap = beta;
      beta = beta_prev;
      beta_prev = swap;
    }
    if (summed_pairs) {
      for (int64_t k = lane; k < TT; k += kWarpSize) pairs[k] = static_cast<scalar_t>(g * pair_sum[k]);
    }
  }
}

// Warps for a launch of `kernel` over B sentences, each warp with per_warp_bytes of workspace: at
// most what the device holds at once and what kWorkspaceBudget allows, at least one block.
template <typename Kernel>
int64_t launch_warps(Kernel kernel, int64_t per_warp_bytes, int64_t B) {
  int blocks_per_multiprocessor = 0;
  CRFKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_multiprocessor, kernel, kThreads, 0));
  const int64_t resident = std::max<int64_t>(1, (int64_t)blocks_per_multiprocessor * kWarpsPerBlock *
                                                    current_device_attribute(cudaDevAttrMultiProcessorCount));
  const int64_t wanted =
      std::min({std::max<int64_t>(B, 1), resident, std::max<int64_t>(1, kWorkspaceBudget / std::max<int64_t>(1, per_warp_bytes))});
  return std::max<int64_t>(1, (wanted + kWarpsPerBlock - 1) / kWarpsPerBlock) * kWarpsPerBlock;
}

template <typename scalar_t>
PerExampleArgs<scalar_t> per_example_args(const CrfArgs& a, Status& status) {
  PerExampleArgs<scalar_t> p;
  set_crf_arguments<scalar_t>(p, a, status);
  p.trans_positions = a.transitions.size(1);
  p.checks = input_checks<scalar_t>(a, status);
  return p;
}

// One launch of forward_backward_kernel (outputs zero-filled by the caller).
template <typename scalar_t>
void launch_forward_backward(const CrfArgs& a, Status& status, const FbOutputs<scalar_t>& out) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  check_sizes(T, 1);
  if (B == 0) return;  // nothing to launch: checked_launch runs the standalone value check
  const auto kernel = forward_backward_kernel<scalar_t>;
  const int64_t doubles = fb_workspace_doubles(L, T, out.pairs != nullptr && !out.pairs_per_position);
  const int64_t warps = launch_warps(kernel, doubles * (int64_t)sizeof(double), B);
  Tensor workspace = empty({warps, doubles}, options_of(a.emissions).dtype(kDouble));
  const PerExampleArgs<scalar_t> p = per_example_args<scalar_t>(a, status);
  kernel<<<(unsigned)(warps / kWarpsPerBlock), kThreads, 0, current_stream()>>>(p, out,
                                                                               workspace.mutable_data_ptr<double>());
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
scalar_t* pointer(const Tensor& x) {
  return x.mutable_data_ptr<scalar_t>();
}

// ---- Viterbi and k-best -------------------------------------------------------------------------

// Per warp: delta and its successor (2, T) in scalar_t, backpointers (L, T) int64.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) viterbi_kernel(PerExampleArgs<scalar_t> p, scalar_t* scores,
                                                           int64_t* paths, unsigned char* workspace,
                                                           int64_t workspace_bytes) {
  check_inputs(p.checks);
  const int lane = threadIdx.x % kWarpSize;
  const int T = p.num_tags;
  const int64_t L = p.max_len;
  unsigned char* mine = workspace + warp_index() * workspace_bytes;
  int64_t* backpointers = reinterpret_cast<int64_t*>(mine);
  scalar_t* delta = reinterpret_cast<scalar_t*>(mine + align_up(L * T * sizeof(int64_t)));
  scalar_t* next = delta + T;
  for (int64_t b = warp_index(); b < p.batch; b += warp_count()) {
    __syncwarp();
    const int64_t n = safe_length(p.lengths, b, L);
    if (!emissions_ok(p, b, n, lane)) continue;
    if (n == 0) {  // the empty sequence
      if (lane == 0) scores[b] = 0;
      continue;
    }
    const Sentence<scalar_t> x = p.sentence(b);
    for (int t = lane; t < T; t += kWarpSize) delta[t] = x.start[t] + x.emit[t];
    __syncwarp();
    for (int64_t i = 1; i < n; ++i) {
      const scalar_t* trans = x.trans_at(i);
      for (int t = lane; t < T; t += kWarpSize) {
        scalar_t best = delta[0] + trans[t];
        int64_t arg = 0;
        for (int s = 1; s < T; ++s) {
          const scalar_t candidate = delta[s] + trans[s * T + t];
          if (candidate > best) {  // strict: the smaller predecessor wins a tie
            best = candidate;
            arg = s;
          }
        }
        next[t] = best + x.emit[i * T + t];
        backpointers[i * T + t] = arg;
      }
      __syncwarp();  // next and the backpointers whole, delta read
      scalar_t* swap = delta;
      delta = next;
      next = swap;
    }
    if (lane == 0) {
      scalar_t best = delta[0] + x.end[0];
      int64_t tag = 0;
      for (int t = 1; t < T; ++t) {
        if (delta[t] + x.end[t] > best) {
          best = delta[t] + x.end[t];
          tag = t;
        }
      }
      scores[b] = best;
      if (best != neg_inf<scalar_t>()) {  // every sequence forbidden: the path stays -1
        int64_t* path = paths + b * L;
        for (int64_t i = n - 1; i >= 0; --i) {
          path[i] = tag;
          if (i > 0) tag = backpointers[i * T + tag];
        }
      }
    }
  }
}

// Per warp, for lists of K: lists and their successor (2, T, K), each lane's merge scratch (32, T)
// of heads and of head values, the final merge's values (K) and codes (K), backpointers (L, T, K).
struct KbestLayout {
  int64_t T, K, L;
  __host__ __device__ int64_t backpointer_bytes() const { return align_up(L * T * K * sizeof(int64_t)); }
  __host__ __device__ int64_t heads_bytes() const { return align_up(kWarpSize * T * sizeof(int64_t)); }
  __host__ __device__ int64_t codes_bytes() const { return align_up(K * sizeof(int64_t)); }
  template <typename scalar_t>
  __host__ __device__ int64_t bytes() const {
    return backpointer_bytes() + heads_bytes() + codes_bytes() + align_up((2 * T * K + kWarpSize * T + K) * sizeof(scalar_t));
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) kbest_kernel(PerExampleArgs<scalar_t> p, int64_t k, KbestLayout layout,
                                                         scalar_t* scores, int64_t* paths, unsigned char* workspace) {
  check_inputs(p.checks);
  const int lane = threadIdx.x % kWarpSize;
  const int T = p.num_tags;
  const int64_t L = p.max_len, K = layout.K;
  unsigned char* mine = workspace + warp_index() * layout.bytes<scalar_t>();
  int64_t* backpointers = reinterpret_cast<int64_t*>(mine);  // (L, T, K): code s * K + rank of the predecessor
  int64_t* heads = reinterpret_cast<int64_t*>(mine + layout.backpointer_bytes());  // (32, T)
  int64_t* codes = reinterpret_cast<int64_t*>(mine + layout.backpointer_bytes() + layout.heads_bytes());
  scalar_t* lists = reinterpret_cast<scalar_t*>(mine + layout.backpointer_bytes() + layout.heads_bytes() +
                                                layout.codes_bytes());
  scalar_t* next = lists + T * K;
  scalar_t* head_values = next + T * K;  // (32, T)
  scalar_t* values = head_values + kWarpSize * T;
  int64_t* my_heads = heads + lane * T;
  scalar_t* my_head_values = head_values + lane * T;
  for (int64_t b = warp_index(); b < p.batch; b += warp_count()) {
    __syncwarp();
    const int64_t n = safe_length(p.lengths, b, L);
    if (!emissions_ok(p, b, n, lane)) continue;
    if (n == 0) {  // exactly one sequence, the empty one, of score 0
      if (lane == 0) scores[b * k] = 0;
      continue;
    }
    const Sentence<scalar_t> x = p.sentence(b);
    for (int t = lane; t < T; t += kWarpSize) {  // position 0: one sequence per tag
      lists[t * K] = x.start[t] + x.emit[t];
      for (int64_t r = 1; r < K; ++r) lists[t * K + r] = neg_inf<scalar_t>();
    }
    __syncwarp();
    for (int64_t i = 1; i < n; ++i) {
      const scalar_t* trans = x.trans_at(i);
      for (int t = lane; t < T; t += kWarpSize) {
        // (lists[s][r] + trans_i[s, t]) + emit_i[t]: -inf stays -inf (emissions are never +inf);
        // the merge's values go straight into next's row t, then get the emission.
        scalar_t* row = next + t * K;
        merge_sorted_lists(lists, trans + t, T, T, K, row, backpointers + (i * T + t) * K, my_heads, my_head_values);
        for (int64_t r = 0; r < K; ++r) row[r] = row[r] + x.emit[i * T + t];
      }
      __syncwarp();
      scalar_t* swap = lists;
      lists = next;
      next = swap;
    }
    if (lane == 0) merge_sorted_lists(lists, x.end, 1, T, K, values, codes, my_heads, my_head_values);
    __syncwarp();
    // Row r (a lane each): its score and its path traced back, where it holds a sequence.
    for (int64_t r = lane; r < K; r += kWarpSize) {
      if (values[r] == neg_inf<scalar_t>()) continue;  // fewer than K sequences exist
      scores[b * k + r] = values[r];
      int64_t code = codes[r];
      int64_t* path = paths + (b * k + r) * L;
      for (int64_t i = n - 1; i >= 0; --i) {
        path[i] = code / K;
        if (i > 0) code = backpointers[(i * T) * K + code];
      }
    }
  }
}

std::tuple<Tensor, Tensor> launch_viterbi_per_example(const CrfArgs& a, Status& status) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  check_sizes(T, 1);
  Tensor paths = full({B, L}, -1, options_of(a.lengths));
  Tensor scores = empty({B}, options_of(a.emissions));
  if (B == 0) return {scores, paths};
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_viterbi_per_example_cuda", [&] {
    const auto kernel = viterbi_kernel<scalar_t>;
    const int64_t bytes = align_up(L * T * sizeof(int64_t)) + align_up(2 * T * sizeof(scalar_t));
    const int64_t warps = launch_warps(kernel, bytes, B);
    Tensor workspace = empty({warps * bytes}, options_of(a.lengths).dtype(kByte));
    kernel<<<(unsigned)(warps / kWarpsPerBlock), kThreads, 0, current_stream()>>>(
        per_example_args<scalar_t>(a, status), pointer<scalar_t>(scores), pointer<int64_t>(paths),
        workspace.mutable_data_ptr<uint8_t>(), bytes);
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {scores, paths};
}

std::tuple<Tensor, Tensor> launch_kbest_per_example(const CrfArgs& a, int64_t k, Status& status) {
  CRFKIT_CHECK_VALUE(k >= 1, "crfkit: k must be at least 1, got ", k);
  if (k == 1) {  // the 1-best is Viterbi, with the same tie rule (as the CPU)
    auto [best_scores, best_paths] = launch_viterbi_per_example(a, status);
    return {torch::stable::unsqueeze(best_scores, 1), torch::stable::unsqueeze(best_paths, 1)};
  }
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const int64_t K = num_sequences_capped(T, L, k);  // longer lists would only hold -inf
  check_sizes(T, K);
  Tensor paths = full({B, k, L}, -1, options_of(a.lengths));
  Tensor scores = full({B, k}, -std::numeric_limits<double>::infinity(), options_of(a.emissions));
  if (B == 0) return {scores, paths};
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_kbest_viterbi_per_example_cuda", [&] {
    const auto kernel = kbest_kernel<scalar_t>;
    const KbestLayout layout{T, K, L};
    const int64_t bytes = layout.bytes<scalar_t>();
    const int64_t warps = launch_warps(kernel, bytes, B);
    Tensor workspace = empty({warps * bytes}, options_of(a.lengths).dtype(kByte));
    kernel<<<(unsigned)(warps / kWarpsPerBlock), kThreads, 0, current_stream()>>>(
        per_example_args<scalar_t>(a, status), k, layout, pointer<scalar_t>(scores), pointer<int64_t>(paths),
        workspace.mutable_data_ptr<uint8_t>());
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {scores, paths};
}

// The 2-D op's arithmetic per sentence, nothing summed over the batch: grad_emissions = g[b] *
// marginals within the length, grad_transitions[b] = g[b] * counts[b], grad_start[b] / grad_end[b] =
// g[b] * the marginals at the first / last position (0 for a length-0 sentence). One thread per
// (b, k) entry of the largest output; also checks the lengths' range.
template <typename scalar_t>
__global__ void backward_from_marginals_kernel(const scalar_t* g, const scalar_t* marginals, const scalar_t* counts,
                                               const int64_t* lengths, scalar_t* grad_emissions,
                                               scalar_t* grad_transitions, scalar_t* grad_start, scalar_t* grad_end,
                                               int64_t B, int64_t L, int64_t T, int64_t pairs,
                                               InputChecks<scalar_t> checks) {
  check_inputs(checks);
  const int64_t per_sentence = max_(L * T, pairs);
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < B * per_sentence;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = idx / per_sentence, k = idx - b * per_sentence;
    const int64_t n = safe_length(lengths, b, L);
    if (k < pairs) grad_transitions[b * pairs + k] = g[b] * counts[b * pairs + k];
    if (k < L * T && k / T < n) {  // positions past the length stay exactly 0 (also for an infinite g)
      grad_emissions[b * L * T + k] = g[b] * marginals[b * L * T + k];
    }
    if (k < T && n > 0) {
      grad_start[b * T + k] = g[b] * marginals[b * L * T + k];
      grad_end[b * T + k] = g[b] * marginals[(b * L + n - 1) * T + k];
    }
  }
}

}  // namespace

Tensor log_partition_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                                 const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [](const CrfArgs& a, Status& status) {
    Tensor log_z = empty({a.emissions.size(0)}, options_of(a.emissions));
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_log_partition_per_example_cuda", [&] {
      FbOutputs<scalar_t> out;
      out.log_z = pointer<scalar_t>(log_z);
      launch_forward_backward<scalar_t>(a, status, out);
    });
    return log_z;
  }, /*per_example=*/true);
}

Tensor marginals_per_example(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                             const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [](const CrfArgs& a, Status& status) {
    Tensor marginals = zeros_like(a.emissions);
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_marginals_per_example_cuda", [&] {
      FbOutputs<scalar_t> out;
      out.marginals = pointer<scalar_t>(marginals);
      launch_forward_backward<scalar_t>(a, status, out);
    });
    return marginals;
  }, /*per_example=*/true);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_per_example(
    const Tensor& grad_log_z_in, const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
    const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    const Tensor grad_log_z = as_contiguous(grad_log_z_in);
    check_argument_like(grad_log_z, "grad_log_z", "(batch,)", {a.emissions.size(0)}, a.emissions, "emissions");
    Tensor grad_emissions = zeros_like(a.emissions), grad_transitions = zeros_like(a.transitions),
           grad_start = zeros_like(a.start), grad_end = zeros_like(a.end);
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_log_partition_backward_per_example_cuda", [&] {
      FbOutputs<scalar_t> out;
      out.grad_log_z = pointer<scalar_t>(grad_log_z);
      out.marginals = pointer<scalar_t>(grad_emissions);
      out.pairs = pointer<scalar_t>(grad_transitions);
      out.pairs_per_position = a.transitions.size(1) != 1;
      out.start = pointer<scalar_t>(grad_start);
      out.end = pointer<scalar_t>(grad_end);
      launch_forward_backward<scalar_t>(a, status, out);
    });
    return std::make_tuple(grad_emissions, grad_transitions, grad_start, grad_end);
  }, /*per_example=*/true);
}

std::tuple<Tensor, Tensor, Tensor> log_partition_with_marginals_per_example(
    const Tensor& emissions, const Tensor& transitions, const Tensor& lengths, const Tensor& start,
    const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [](const CrfArgs& a, Status& status) {
    Tensor log_z = empty({a.emissions.size(0)}, options_of(a.emissions));
    Tensor marginals = zeros_like(a.emissions), counts = zeros_like(a.transitions);
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_log_partition_with_marginals_per_example_cuda",
                                   [&] {
      FbOutputs<scalar_t> out;
      out.log_z = pointer<scalar_t>(log_z);
      out.marginals = pointer<scalar_t>(marginals);
      out.pairs = pointer<scalar_t>(counts);
      out.pairs_per_position = a.transitions.size(1) != 1;
      launch_forward_backward<scalar_t>(a, status, out);
    });
    return std::make_tuple(log_z, marginals, counts);
  }, /*per_example=*/true);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_from_marginals_per_example(
    const Tensor& grad_log_z_in, const Tensor& marginals_in, const Tensor& counts_in, const Tensor& lengths_in) {
  const Tensor grad_log_z = as_contiguous(grad_log_z_in), marginals = as_contiguous(marginals_in),
               counts = as_contiguous(counts_in), lengths = as_contiguous(lengths_in);
  check_backward_from_marginals_arguments(grad_log_z, marginals, counts, lengths);
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2);
  CRFKIT_CHECK(marginals.is_cuda(), "crfkit: the CUDA kernels take CUDA tensors, got marginals on ",
               marginals.device());
  const torch::stable::accelerator::DeviceGuard guard(marginals.get_device_index());
  Status status(marginals);
  Tensor grad_emissions = zeros_like(marginals), grad_transitions = empty_as(counts);
  Tensor grad_start = zeros({B, T}, options_of(marginals)), grad_end = zeros({B, T}, options_of(marginals));
  const int64_t pairs = counts.size(1) * T * T;
  CRFKIT_DISPATCH_FLOATING_TYPES(marginals.scalar_type(), "crfkit_log_partition_backward_from_marginals_per_example",
                                 [&] {
    const InputChecks<scalar_t> checks = input_checks_of<scalar_t>(lengths, L, {}, {}, {}, status);
    const auto blocks = (unsigned)grid_stride_blocks(std::max<int64_t>(1, B * std::max(L * T, pairs)), kThreads, 4096);
    backward_from_marginals_kernel<scalar_t><<<blocks, kThreads, 0, current_stream()>>>(
        pointer<scalar_t>(grad_log_z), pointer<scalar_t>(marginals), pointer<scalar_t>(counts),
        pointer<int64_t>(lengths), pointer<scalar_t>(grad_emissions), pointer<scalar_t>(grad_transitions),
        pointer<scalar_t>(grad_start), pointer<scalar_t>(grad_end), B, L, T, pairs, checks);
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  });
  status.raise_if_bad(lengths, L);
  return {grad_emissions, grad_transitions, grad_start, grad_end};
}

Tensor expected_transition_counts_per_example(const Tensor& emissions, const Tensor& transitions,
                                              const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [](const CrfArgs& a, Status& status) {
    const int64_t B = a.emissions.size(0), T = a.emissions.size(2);
    Tensor counts = zeros({B, T, T}, options_of(a.emissions));
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_expected_transition_counts_per_example_cuda",
                                   [&] {
      FbOutputs<scalar_t> out;
      out.pairs = pointer<scalar_t>(counts);  // summed over positions, also for Lt = L
      launch_forward_backward<scalar_t>(a, status, out);
    });
    return counts;
  }, /*per_example=*/true);
}

std::tuple<Tensor, Tensor> viterbi_per_example(const Tensor& emissions, const Tensor& transitions,
                                               const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, launch_viterbi_per_example,
                        /*per_example=*/true);
}

std::tuple<Tensor, Tensor> kbest_viterbi_per_example(const Tensor& emissions, const Tensor& transitions, int64_t k,
                                                     const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end,
                        [&](const CrfArgs& a, Status& status) { return launch_kbest_per_example(a, k, status); },
                        /*per_example=*/true);
}

std::tuple<Tensor, Tensor, Tensor> kbest_viterbi_with_log_probs_per_example(
    const Tensor& emissions, const Tensor& transitions, int64_t k, const Tensor& lengths, const Tensor& start,
    const Tensor& end) {
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    Tensor log_z = empty({a.emissions.size(0)}, options_of(a.emissions));
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_kbest_log_z_per_example_cuda", [&] {
      FbOutputs<scalar_t> out;
      out.log_z = pointer<scalar_t>(log_z);
      launch_forward_backward<scalar_t>(a, status, out);
    });
    auto [scores, paths] = launch_kbest_per_example(a, k, status);
    return std::make_tuple(scores, paths, log_probs_from_scores(scores, log_z));
  }, /*per_example=*/true);
}

}  // namespace cuda
}  // namespace crfkit
