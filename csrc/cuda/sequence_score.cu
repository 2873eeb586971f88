// CUDA kernels: the score of given tag sequences and its gradient (a scatter of the weights).
//
// tags (B, N, L) int64: N candidate sequences per sentence. sequence_score: one thread per
// sequence (b, j), accumulating left to right in the order of the Viterbi kernels and of the
// CPU kernel, so the score of a decoded path equals the decoder's score bit for bit (additions
// only, no FMA contraction possible). sequence_score_backward: one thread per sentence adds
// the weights of its N sequences to its own emission gradients (no atomics, deterministic);
// the transition / start / end gradients, shared by all sentences, use atomicAdd (the sums of
// the weights can then differ in the last bits between runs when the weights are not
// integers; the CPU kernel sums per sentence in a fixed order). sequence_score also takes
// per-example transitions (B, Lt, T, T) with start, end (B, T) (csrc/cpu/per_example.h); its
// backward for those is compiled.py's (_per_example_path_score_grads).
#include "common.cuh"

namespace crfkit {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride loops cover the rest

int64_t blocks_for(int64_t count) { return grid_stride_blocks(count, kThreads, kMaxBlocks); }

// First position i < n of y with a tag outside [0, T), or -1.
__device__ __forceinline__ int64_t first_bad_tag(const int64_t* y, int64_t n, int64_t T) {
  for (int64_t i = 0; i < n; ++i) {
    if (y[i] < 0 || y[i] >= T) return i;
  }
  return -1;
}

// Where sentence b's parameters start: shared ones (T, T), (T,) have strides 0; per-example
// ones (B, Lt, T, T), (B, T) have trans_batch = Lt * T * T, trans_step = T * T for Lt = L (else
// 0) and parameter = T.
struct ParameterStrides {
  int64_t trans_batch = 0, trans_step = 0, parameter = 0;
};

template <typename scalar_t>
__global__ void sequence_score_kernel(const scalar_t* emissions, const scalar_t* transitions, const scalar_t* start,
                                      const scalar_t* end, const int64_t* lengths, const int64_t* tags,
                                      scalar_t* scores, int64_t batch, int64_t num_sequences, int64_t max_len,
                                      int64_t T, ParameterStrides strides, long long* status) {
  const int64_t count = batch * num_sequences;
  for (int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; row < count;
       row += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = row / num_sequences;
    const int64_t n = safe_length(lengths, b, max_len);
    const int64_t* y = tags + row * max_len;
    if (n == 0) {
      scores[row] = 0;
      continue;
    }
    const int64_t bad = first_bad_tag(y, n, T);
    if (bad >= 0) {  // never index with it
      report(status, kBadTag, row * max_len + bad);
      continue;
    }
    const scalar_t* e = emissions + b * max_len * T;
    const scalar_t* trans = transitions + b * strides.trans_batch;
    scalar_t score = start[b * strides.parameter + y[0]] + e[y[0]];
    for (int64_t i = 1; i < n; ++i) {
      score = (score + trans[i * strides.trans_step + y[i - 1] * T + y[i]]) + e[i * T + y[i]];
    }
    scores[row] = score + end[b * strides.parameter + y[n - 1]];
  }
}

// One thread per sentence. Rows whose first tag is -1 (k-best rows that hold no sequence)
// contribute nothing; other rows must hold valid tags within the length.
template <typename scalar_t>
__global__ void sequence_score_backward_kernel(const scalar_t* grad_scores, const int64_t* lengths,
                                               const int64_t* tags, scalar_t* grad_emissions,
                                               scalar_t* grad_transitions, scalar_t* grad_start, scalar_t* grad_end,
                                               int64_t batch, int64_t num_sequences, int64_t max_len, int64_t T,
                                               long long* status) {
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < batch; b += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = safe_length(lengths, b, max_len);
    if (n == 0) continue;
    scalar_t* ge = grad_emissions + b * max_len * T;
    for (int64_t j = 0; j < num_sequences; ++j) {
      const int64_t row = b * num_sequences + j;
      const int64_t* y = tags + row * max_len;
      if (y[0] == -1) continue;
      const int64_t bad = first_bad_tag(y, n, T);
      if (bad >= 0) {
        report(status, kBadTag, row * max_len + bad);
        continue;
      }
      const scalar_t w = grad_scores[row];
      if (w == 0) continue;
      atomicAdd(grad_start + y[0], w);
      atomicAdd(grad_end + y[n - 1], w);
      for (int64_t i = 0; i < n; ++i) ge[i * T + y[i]] += w;
      for (int64_t i = 1; i < n; ++i) atomicAdd(grad_transitions + y[i - 1] * T + y[i], w);
    }
  }
}

// (B, N): score of each sequence; 0 for a length-0 sentence.
Tensor sequence_score_cuda(const Tensor& emissions_in, const Tensor& transitions_in,
                               const Tensor& tags_in, const Tensor& lengths_in, const Tensor& start_in,
                               const Tensor& end_in) {
  const bool per_example = transitions_in.dim() == 4;
  const CrfArgs a = checked_cuda_args(emissions_in, transitions_in, lengths_in, start_in, end_in, per_example);
  const Tensor tags = as_contiguous(tags_in);
  check_tags(tags, a.emissions);
  const torch::stable::accelerator::DeviceGuard guard(a.emissions.get_device_index());
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const int64_t N = tags.size(1);
  Status status(a.emissions);
  launch_validate_inputs(a.lengths, L, a.transitions, a.start, a.end, status);
  // The same NaN / +inf rule as every other op, although a score reads one tag per position.
  launch_check_emissions(a.emissions, a.lengths, status);
  Tensor scores = empty({B, N}, options_of(a.emissions));
  ParameterStrides strides;
  if (per_example) {
    const int64_t Lt = a.transitions.size(1);
    strides = {Lt * T * T, Lt == 1 ? 0 : T * T, T};
  }
  if (B * N > 0) {
    CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_sequence_score_cuda", [&] {
      sequence_score_kernel<scalar_t><<<blocks_for(B * N), kThreads, 0, current_stream()>>>(
          a.emissions.mutable_data_ptr<scalar_t>(), a.transitions.mutable_data_ptr<scalar_t>(), a.start.mutable_data_ptr<scalar_t>(),
          a.end.mutable_data_ptr<scalar_t>(), a.lengths.mutable_data_ptr<int64_t>(), tags.mutable_data_ptr<int64_t>(),
          scores.mutable_data_ptr<scalar_t>(), B, N, L, T, strides, status.data());
      CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  status.raise_if_bad(a.lengths, L, tags, T);
  return scores;
}

// Gradients of sum_{b, j} grad_scores[b, j] * score(tags[b, j]) with respect to emissions
// (B, L, T), transitions (T, T), start (T,) and end (T,).
std::tuple<Tensor, Tensor, Tensor, Tensor> sequence_score_backward_cuda(
    const Tensor& grad_scores_in, const Tensor& emissions, const Tensor& tags_in,
    const Tensor& lengths_in) {
  // emissions only give the shape, dtype and device of the gradient; nothing of them is read.
  const Tensor grad_scores = as_contiguous(grad_scores_in);
  const Tensor lengths = as_contiguous(lengths_in);
  const Tensor tags = as_contiguous(tags_in);
  check_emissions_argument(emissions);
  CRFKIT_CHECK(emissions.is_cuda(), "crfkit: emissions must be a CUDA tensor here, got one on ", emissions.device());
  check_tags(tags, emissions);
  const torch::stable::accelerator::DeviceGuard guard(emissions.get_device_index());
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  const int64_t N = tags.size(1);
  check_argument_like(grad_scores, "grad_scores", "(batch, num_sequences)", {B, N}, emissions, "emissions");
  check_lengths_argument(lengths, B, emissions);
  Status status(emissions);
  launch_validate_inputs(lengths, L, Tensor(), Tensor(), Tensor(), status);
  auto grad_emissions = zeros(emissions.sizes(), options_of(emissions));  // dense, whatever emissions' strides
  auto grad_transitions = zeros({T, T}, options_of(emissions));
  auto grad_start = zeros({T}, options_of(emissions));
  auto grad_end = zeros({T}, options_of(emissions));
  if (B > 0 && N > 0) {
    CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_sequence_score_backward_cuda", [&] {
      sequence_score_backward_kernel<scalar_t><<<blocks_for(B), kThreads, 0, current_stream()>>>(
          grad_scores.mutable_data_ptr<scalar_t>(), lengths.mutable_data_ptr<int64_t>(), tags.mutable_data_ptr<int64_t>(),
          grad_emissions.mutable_data_ptr<scalar_t>(), grad_transitions.mutable_data_ptr<scalar_t>(),
          grad_start.mutable_data_ptr<scalar_t>(), grad_end.mutable_data_ptr<scalar_t>(), B, N, L, T, status.data());
      CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  status.raise_if_bad(lengths, L, tags, T);
  return {grad_emissions, grad_transitions, grad_start, grad_end};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("sequence_score", TORCH_BOX(&sequence_score_cuda));
  m.impl("sequence_score_backward", TORCH_BOX(&sequence_score_backward_cuda));
}

}  // namespace cuda
}  // namespace crfkit
