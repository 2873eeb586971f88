// CUDA kernels: log partition (forward algorithm), marginals and the analytic backward of
// log Z (forward-backward), one fused kernel per op with the whole time loop inside.
//
// Two kernels: for T <= 32 (float; 16 in double) register_forward_backward_kernel
// (forward_backward_registers.cuh), with every per-position value in registers; otherwise
// forward_backward_kernel (forward_backward.cuh), described here. What they share (the op's
// outputs, the transition tables, the launch parameters, the end of the forward pass) is in
// forward_backward_common.cuh; this file holds the launches, the ops and the backward from
// saved marginals.
// Layout: one group of G lanes per sentence (common.cuh); lane l owns tags l, l + G, ...
// Per position and tag the forward step is the factored log-space step of the CPU kernels
// (csrc/cpu/log_space.h):
//     alpha_next[t] = col_max[t] + log(sum_s p[s] * E[s][t]) + emit[t],
//     p[s] = exp(alpha_hat[s])  (alpha_hat normalised to max 0: p <= 1),
//     E[s][t] = exp(trans[s, t] - col_max[t])  (one table for the whole call),
// i.e. one exponential (p of the lane's own tag, shared through the group's arena), T
// multiply-adds and one logarithm per tag; a column whose sum falls below trusted_sum_min
// (csrc/numerics.h) is recomputed exactly (max-shifted logsumexp). The rows are normalised
// after every position (offsets accumulated in double), exactly like the CPU kernels, so
// float32 stays accurate on long sentences with large scores. Results agree with the CPU kernels to rounding, not bit
// for bit (different summation order, and the CPU also has a probability-space fast path).
//
// Marginals / backward / log Z with marginals: the forward pass stores the normalised alpha
// rows in the OUTPUT tensor itself (B, L, T) (no extra O(B L T) workspace), and the backward
// pass, from the last position to the first, reads row i, overwrites it with the marginals of
// position i, and reads row i-1 for the pairwise (transition) marginals. The same lane wrote
// and reads each entry. The running offsets (needed for the pairwise shift against log Z) go to
// a per-group (L,) double workspace. Marginals are normalised per position (they sum to one),
// pairwise marginals per position pair, as in the CPU kernels. Gradients of transitions /
// start / end are accumulated per group (in shared memory when it fits, else in a per-group
// slice of global memory) and summed over groups afterwards in a fixed order: deterministic for
// a given device.
//
// log_partition_with_marginals (the forward of a differentiable log Z, csrc/autograd.cpp) runs
// the same kernel for an upstream gradient of 1 and keeps per sentence what the backward sums
// over the batch: log Z, the marginals and the expected transition counts (B, T, T). The
// backward is then log_partition_backward_from_marginals (below): those scaled by the upstream
// gradient, with no second forward-backward pass and no second status read.
#include "common.cuh"
#include "per_example.cuh"
#include "forward_backward.cuh"
#include "forward_backward_chunked.cuh"
#include "forward_backward_common.cuh"
#include "forward_backward_registers.cuh"

namespace crfkit {
namespace cuda {
namespace {

struct FbOutputs {
  Tensor log_z;   // (B,)
  Tensor rows;    // (B, L, T) marginals (weighted by grad_log_z for the backward)
  Tensor counts;  // (B, T, T) expected transition counts (kWithMarginals)
  Tensor grad_transitions, grad_start, grad_end;
};

// ---- elementwise kernels: the backward from saved marginals (and the chunked path's) -------------
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 4096;  // grid-stride loops cover the rest

int64_t elementwise_blocks(int64_t count) {
  return grid_stride_blocks(count, kElementwiseThreads, kMaxElementwiseBlocks);
}

// grad_emissions[b, i, t] = grad_log_z[b] * marginals[b, i, t] within sentence b's length,
// exactly 0 beyond it (also for an infinite grad_log_z).
template <typename scalar_t>
__global__ void scale_marginals_kernel(const scalar_t* grad_log_z, const scalar_t* marginals, const int64_t* lengths,
                                       scalar_t* grad_emissions, int64_t batch, int64_t max_len, int64_t T) {
  const int64_t count = batch * max_len * T;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = k / (max_len * T);
    const int64_t i = k / T % max_len;
    grad_emissions[k] = i < lengths[b] ? grad_log_z[b] * marginals[k] : scalar_t(0);
  }
}

// The gradients shared by all sentences: transitions [0, T*T), start [T*T, T*T + T), end
// [T*T + T, T*T + 2T), one WARP per entry: lane l sums the sentences b = l, l + 32, ... in order,
// then a butterfly over the lanes adds the 32 partial sums, in the same order on every run
// (deterministic for a given device; it differs from the CPU kernel's sequential order by
// rounding only). One thread per entry summing all B sentences in order was slow, mostly
// waiting on one load after another (benchmarks/results/NOTES.md has the timings).
// Start / end read each sentence's first / last row of marginals; empty sentences (and lengths
// out of range, reported by check_inputs) add nothing. `checks`: the call's input checks, where
// this kernel runs them.
template <typename scalar_t>
__global__ void sum_parameter_grads_kernel(const scalar_t* grad_log_z, const scalar_t* marginals,
                                           const scalar_t* counts, const int64_t* lengths,
                                           scalar_t* grad_transitions, scalar_t* grad_start, scalar_t* grad_end,
                                           int64_t batch, int64_t max_len, int64_t T,
                                           const InputChecks<scalar_t> checks) {
  check_inputs(checks);
  const int64_t count = T * T + 2 * T;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  for (int64_t k = (int64_t)blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; k < count;
       k += (int64_t)gridDim.x * warps_per_block) {  // k is warp-uniform: the shuffles below are legal
    const bool is_transition = k < T * T;
    const bool is_start = !is_transition && k < T * T + T;
    const int64_t t = is_transition ? 0 : (is_start ? k - T * T : k - T * T - T);
    scalar_t sum = 0;
    for (int64_t b = lane; b < batch; b += kWarpSize) {
      if (is_transition) {
        sum += grad_log_z[b] * counts[b * T * T + k];
      } else {
        const int64_t n = safe_length(lengths, b, max_len);
        if (n > 0) sum += grad_log_z[b] * marginals[(b * max_len + (is_start ? 0 : n - 1)) * T + t];
      }
    }
    sum = group_sum(sum, kWarpSize);
    if (lane == 0) (is_transition ? grad_transitions + k : (is_start ? grad_start : grad_end) + t)[0] = sum;
  }
}

template <typename scalar_t>
void launch_sum_parameter_grads(const Tensor& grad_log_z, const Tensor& marginals, const Tensor& counts,
                                const Tensor& lengths, Tensor& grad_transitions, Tensor& grad_start,
                                Tensor& grad_end, const InputChecks<scalar_t>& checks = {}) {
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2);
  const int64_t blocks = elementwise_blocks((T * T + 2 * T) * kWarpSize);  // one warp per entry
  const cudaStream_t stream = current_stream();
  sum_parameter_grads_kernel<scalar_t><<<blocks, kElementwiseThreads, 0, stream>>>(
      grad_log_z.mutable_data_ptr<scalar_t>(), marginals.mutable_data_ptr<scalar_t>(), counts.mutable_data_ptr<scalar_t>(),
      lengths.mutable_data_ptr<int64_t>(), grad_transitions.mutable_data_ptr<scalar_t>(), grad_start.mutable_data_ptr<scalar_t>(),
      grad_end.mutable_data_ptr<scalar_t>(), B, L, T, checks);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- parallel in time (forward_backward_chunked.cuh; the choice: time_chunk_length, common.cu) --
// The chunked forward-backward of one call (see forward_backward_chunked.cuh) for T within the
// register kernel's range: out.log_z and out.rows are allocated by the caller, `tables` filled.
// `skip` (B,) int: zeroed by the tables kernel.
template <typename scalar_t, Output kOut, int kLanes>
void launch_chunked(const CrfArgs& a, const Tensor& grad_log_z, const Tensor& tables, const Tensor& skip,
                    int64_t S, FbOutputs& out, Status& status) {
  constexpr bool kPairwise = kOut == Output::kBackward || kOut == Output::kWithMarginals;
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const int64_t C = (L + S - 1) / S;
  const auto options = options_of(a.emissions);
  const cudaStream_t stream = current_stream();
  Tensor matrices = empty({B * C * T * T}, options);
  Tensor row_offsets = empty({B * C * T}, options.dtype(kDouble));
  const bool keep_rows = kOut != Output::kLogPartition;
  Tensor alpha_in = keep_rows ? empty({B * C * T}, options) : Tensor();
  Tensor beta_out = keep_rows ? empty({B * C * T}, options) : Tensor();
  Tensor offsets = keep_rows ? empty({B * C * S}, options.dtype(kDouble)) : Tensor();

  ChunkParams<scalar_t> params;
  set_chunk_arguments<scalar_t>(params, a, S, C, matrices, status);
  params.tables = tables.mutable_data_ptr<scalar_t>();
  params.row_offsets = row_offsets.mutable_data_ptr<double>();
  params.alpha_in = keep_rows ? alpha_in.mutable_data_ptr<scalar_t>() : nullptr;
  params.beta_out = keep_rows ? beta_out.mutable_data_ptr<scalar_t>() : nullptr;
  params.skip = skip.mutable_data_ptr<int>();
  params.log_z = out.log_z.defined() ? out.log_z.mutable_data_ptr<scalar_t>() : nullptr;
  params.rows = keep_rows ? out.rows.mutable_data_ptr<scalar_t>() : nullptr;
  params.offsets = keep_rows ? offsets.mutable_data_ptr<double>() : nullptr;
  const auto blocks_for = chunk_group_blocks<kLanes>;

  chunk_transfer_kernel<scalar_t, kLanes><<<blocks_for(B * C * T), kMaxThreadsPerBlock, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  if (!keep_rows) {
    chunk_scan_kernel<scalar_t, kLanes, false><<<blocks_for(B), kMaxThreadsPerBlock, 0, stream>>>(params);
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  chunk_scan_kernel<scalar_t, kLanes, true><<<blocks_for(B), kMaxThreadsPerBlock, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  chunk_marginals_kernel<scalar_t, kLanes, kPairwise><<<blocks_for(B * C), kMaxThreadsPerBlock, 0, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  if (!kPairwise) return;

  Tensor counts = kOut == Output::kWithMarginals ? out.counts : empty({B, T, T}, options);
  sum_chunk_counts_kernel<scalar_t><<<elementwise_blocks(B * T * T), kElementwiseThreads, 0, stream>>>(
      matrices.mutable_data_ptr<scalar_t>(), a.lengths.mutable_data_ptr<int64_t>(), counts.mutable_data_ptr<scalar_t>(), B, L, S, C, T);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  if (kOut == Output::kBackward) {  // as log_partition_backward_from_marginals, with the rows scaled in place
    out.grad_transitions = empty({T, T}, options);
    out.grad_start = empty({T}, options);
    out.grad_end = empty({T}, options);
    launch_sum_parameter_grads<scalar_t>(grad_log_z, out.rows, counts, a.lengths, out.grad_transitions,
                                         out.grad_start, out.grad_end);
    scale_marginals_kernel<scalar_t><<<elementwise_blocks(B * L * T), kElementwiseThreads, 0, stream>>>(
        grad_log_z.mutable_data_ptr<scalar_t>(), out.rows.mutable_data_ptr<scalar_t>(), a.lengths.mutable_data_ptr<int64_t>(),
        out.rows.mutable_data_ptr<scalar_t>(), B, L, T);
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t, Output kOut>
void launch_forward_backward(const CrfArgs& a, const Tensor& grad_log_z, FbOutputs& out, Status& status) {
  constexpr bool kPairwise = kOut == Output::kBackward || kOut == Output::kWithMarginals;
  constexpr bool kWithMarginals = kOut == Output::kWithMarginals;
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  const auto options = options_of(a.emissions);
  const cudaStream_t stream = current_stream();
  if (kOut == Output::kLogPartition || kWithMarginals) out.log_z = empty({B}, options);
  // Written whole by the kernels (zeros beyond each sentence): no fill launch.
  if (kOut != Output::kLogPartition) out.rows = torch::stable::empty_like(a.emissions);
  if (kWithMarginals && B == 0) out.counts = zeros({0, T, T}, options);
  if (B == 0) {
    if (kOut == Output::kBackward) {
      out.grad_transitions = zeros({T, T}, options);
      out.grad_start = zeros({T}, options);
      out.grad_end = zeros({T}, options);
    }
    return;
  }
  // The kernel and where its buffers live: the register kernel for small T (no shared memory,
  // blocks of 4 warps, one group of kLanes >= 8 lanes per sentence), else the generic one; for
  // long sentences at small batch and the register kernel's T, the chunked path (parallel in time).
  const bool in_registers = T <= register_max_tags<scalar_t>();
  const int64_t S = in_registers ? time_chunk_length(B, L, T, register_lanes(T)) : 0;
  const Tensor skip = S > 0 ? empty({B}, options.dtype(kInt)) : Tensor();
  // The tables, and the call's input checks and zeroed `skip`, in one launch.
  Tensor tables = empty({table_elements(T)}, options);
  {
    constexpr int kThreads = 128;
    const int64_t work = std::max({2 * T, B, T * T});
    const auto blocks = (unsigned)std::min<int64_t>((work + kThreads - 1) / kThreads, 1024);
    transition_tables_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        a.transitions.mutable_data_ptr<scalar_t>(), (int)T, tables.mutable_data_ptr<scalar_t>(), input_checks<scalar_t>(a, status),
        S > 0 ? skip.mutable_data_ptr<int>() : nullptr, S > 0 ? B : 0);
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (S > 0) {
    if (kWithMarginals) out.counts = empty({B, T, T}, options);
    dispatch_register_lanes<scalar_t>(T, [&](auto lanes) {
      launch_chunked<scalar_t, kOut, decltype(lanes)::value>(a, grad_log_z, tables, skip, S, out, status);
    });
    return;
  }
  const size_t arena_bytes = align_up((kOut == Output::kLogPartition ? 3 : 7) * T * sizeof(scalar_t));
  const int64_t accumulator_elements = kPairwise ? T * T + 2 * T : 0;
  const size_t accumulator_bytes = align_up(accumulator_elements * sizeof(scalar_t));
  const size_t table_bytes = align_up(table_elements(T) * sizeof(scalar_t));
  SharedPlan plan;
  void (*kernel)(const FbParams<scalar_t>) = nullptr;
  if (in_registers) {
    plan.lanes = register_lanes(T);
    plan.threads = kMaxThreadsPerBlock;
    plan.groups_per_block = plan.threads / plan.lanes;
    dispatch_register_lanes<scalar_t>(T, [&](auto lanes) {
      kernel = register_forward_backward_kernel<scalar_t, kOut, decltype(lanes)::value>;
    });
  } else {
    plan = plan_shared(T, arena_bytes, accumulator_bytes, table_bytes);
    kernel = all_in_shared(plan, kPairwise) ? forward_backward_kernel<scalar_t, kOut, true>
                                            : forward_backward_kernel<scalar_t, kOut, false>;
  }
  const int64_t blocks = persistent_blocks(kernel, plan, B);
  const int64_t slots = blocks * plan.groups_per_block;

  const auto bytes = options.dtype(kByte);
  Tensor arena_workspace = plan.arena_in_shared ? Tensor() : empty({slots * (int64_t)arena_bytes}, bytes);
  // The forward offsets per position: the generic kernel needs them for the pairwise terms, the
  // register kernel also for the marginals (exp(alpha + beta - log Z) with its known shift).
  const bool keep_offsets = kPairwise || (in_registers && kOut == Output::kMarginals);
  Tensor offsets = keep_offsets ? empty({slots, L}, options.dtype(kDouble)) : Tensor();
  // Accumulators in registers or shared memory are written whole (a group's slice of `partials`
  // at its end, each sentence's `counts` at the sentence's end); those in global memory are
  // accumulated into directly, so they start at zero.
  const bool written_whole = in_registers || plan.accumulator_in_shared;
  Tensor partials;
  if (kOut == Output::kBackward) {
    partials = written_whole ? empty({slots, accumulator_elements}, options)
                             : zeros({slots, accumulator_elements}, options);
  }
  if (kWithMarginals) out.counts = written_whole ? empty({B, T, T}, options) : zeros({B, T, T}, options);

  FbParams<scalar_t> params;
  set_crf_arguments<scalar_t>(params, a, status);
  params.grad_log_z = kOut == Output::kBackward ? grad_log_z.mutable_data_ptr<scalar_t>() : nullptr;
  params.tables = tables.mutable_data_ptr<scalar_t>();
  params.log_z = out.log_z.defined() ? out.log_z.mutable_data_ptr<scalar_t>() : nullptr;
  params.rows = kOut != Output::kLogPartition ? out.rows.mutable_data_ptr<scalar_t>() : nullptr;
  params.offsets = keep_offsets ? offsets.mutable_data_ptr<double>() : nullptr;
  params.partials = partials.defined() ? partials.mutable_data_ptr<scalar_t>() : nullptr;
  params.counts = kWithMarginals ? out.counts.mutable_data_ptr<scalar_t>() : nullptr;
  params.arena_workspace = arena_workspace.defined() ? arena_workspace.mutable_data_ptr<uint8_t>() : nullptr;
  params.plan = plan;
  params.arena_bytes = arena_bytes;
  params.accumulator_bytes = accumulator_bytes;
  kernel<<<(unsigned)blocks, plan.threads, plan.shared_bytes, stream>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();

  if (kOut == Output::kBackward) {  // fixed-order sum over the groups' partial sums: deterministic
    Tensor sums = sum_first_dim(partials);  // not const: torch::stable::narrow takes a Tensor&
    out.grad_transitions = torch::stable::clone(torch::stable::reshape(torch::stable::narrow(sums, 0, 0, T * T), {T, T}));
    out.grad_start = torch::stable::clone(torch::stable::narrow(sums, 0, T * T, T));
    out.grad_end = torch::stable::clone(torch::stable::narrow(sums, 0, T * T + T, T));
  }
}

// Table indices are int: T * T must fit.
void check_num_tags(int64_t T) {
  CRFKIT_CHECK_VALUE(T * T < (int64_t{1} << 31), "crfkit: the CUDA kernels support num_tags up to 46340, got ", T);
}

// One forward-backward launch for arguments checked and validated into `status` (the caller
// raises from it): log Z, marginals or gradients, as kOut says, for the emissions' dtype
// (launch_forward_backward<scalar_t, kOut>).
template <Output kOut>
FbOutputs dispatch_forward_backward(const CrfArgs& a, const Tensor& grad_log_z_in, Status& status) {
  const int64_t B = a.emissions.size(0);
  check_num_tags(a.emissions.size(2));
  Tensor grad_log_z;
  if (kOut == Output::kBackward) {
    grad_log_z = as_contiguous(grad_log_z_in);
    check_argument_like(grad_log_z, "grad_log_z", "(batch,)", {B}, a.emissions, "emissions");
  }
  FbOutputs out;
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_forward_backward_cuda", [&] {
    launch_forward_backward<scalar_t, kOut>(a, grad_log_z, out, status);
  });
  return out;
}

// The body of the forward-backward ops below: checks and validates the arguments, launches
// (dispatch_forward_backward) and raises from the status words (checked_launch, common.cuh).
template <Output kOut>
FbOutputs forward_backward_op(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                              const Tensor& start, const Tensor& end, const Tensor& grad_log_z = {}) {
  return checked_launch(emissions, transitions, lengths, start, end, [&](const CrfArgs& a, Status& status) {
    return dispatch_forward_backward<kOut>(a, grad_log_z, status);
  });
}

}  // namespace

// log Z (B,) launched on the current stream for arguments already checked and validated
// (common.cuh); the caller raises from `status` (kbest_viterbi_with_log_probs in kbest.cu).
Tensor launch_log_partition(const CrfArgs& a, Status& status) {
  return dispatch_forward_backward<Output::kLogPartition>(a, Tensor(), status).log_z;
}

namespace {

// log Z per sentence: (B,).
Tensor log_partition_cuda(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                              const Tensor& start, const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) return log_partition_per_example(emissions, transitions, lengths, start, end);
  return forward_backward_op<Output::kLogPartition>(emissions, transitions, lengths, start, end).log_z;
}

// P(y_i = t | x): (B, L, T), zero at padded positions.
Tensor marginals_cuda(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                          const Tensor& start, const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) return marginals_per_example(emissions, transitions, lengths, start, end);
  return forward_backward_op<Output::kMarginals>(emissions, transitions, lengths, start, end).rows;
}

// Gradients of sum_b grad_log_z[b] * log Z[b] with respect to emissions (B, L, T),
// transitions (T, T), start (T,) and end (T,).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_cuda(
    const Tensor& grad_log_z, const Tensor& emissions, const Tensor& transitions,
    const Tensor& lengths, const Tensor& start, const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) {
    return log_partition_backward_per_example(grad_log_z, emissions, transitions, lengths, start, end);
  }
  FbOutputs out = forward_backward_op<Output::kBackward>(emissions, transitions, lengths, start, end, grad_log_z);
  return {out.rows, out.grad_transitions, out.grad_start, out.grad_end};
}

// log Z (B,) and its gradients for grad_log_z = 1, per sentence: the marginals (B, L, T) and the
// expected transition counts (B, T, T). One forward-backward pass, as on the CPU
// (csrc/cpu/log_partition.cpp, log_partition_with_marginals_cpu).
std::tuple<Tensor, Tensor, Tensor> log_partition_with_marginals_cuda(
    const Tensor& emissions, const Tensor& transitions, const Tensor& lengths, const Tensor& start,
    const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) {
    return log_partition_with_marginals_per_example(emissions, transitions, lengths, start, end);
  }
  FbOutputs out = forward_backward_op<Output::kWithMarginals>(emissions, transitions, lengths, start, end);
  return {out.log_z, out.rows, out.counts};
}

// E[number of s -> t transitions] per sentence: (B, T, T).
Tensor expected_transition_counts_cuda(const Tensor& emissions, const Tensor& transitions,
                                           const Tensor& lengths, const Tensor& start,
                                           const Tensor& end) {
  // per-example transitions: per_example.cu
  if (transitions.dim() == 4) {
    return expected_transition_counts_per_example(emissions, transitions, lengths, start, end);
  }
  return forward_backward_op<Output::kWithMarginals>(emissions, transitions, lengths, start, end).counts;
}

// The backward of log_partition_with_marginals: the gradients of sum_b grad_log_z[b] log Z[b]
// with respect to emissions (B, L, T), transitions (T, T), start (T,) and end (T,), from that
// op's marginals (B, L, T) and transition counts (B, T, T). Two small kernels, the second of
// which checks the lengths' range (one status read).
std::tuple<Tensor, Tensor, Tensor, Tensor> log_partition_backward_from_marginals_cuda(
    const Tensor& grad_log_z_in, const Tensor& marginals_in, const Tensor& counts_in,
    const Tensor& lengths_in) {
  if (counts_in.dim() == 4) {  // per-example transitions' counts: per_example.cu
    return log_partition_backward_from_marginals_per_example(grad_log_z_in, marginals_in, counts_in, lengths_in);
  }
  const Tensor grad_log_z = as_contiguous(grad_log_z_in), marginals = as_contiguous(marginals_in),
                   counts = as_contiguous(counts_in), lengths = as_contiguous(lengths_in);
  check_backward_from_marginals_arguments(grad_log_z, marginals, counts, lengths);
  CRFKIT_CHECK(marginals.is_cuda(), "crfkit: the CUDA kernels take CUDA tensors, got marginals on ",
              marginals.device());
  const torch::stable::accelerator::DeviceGuard guard(marginals.get_device_index());
  const int64_t B = marginals.size(0), L = marginals.size(1), T = marginals.size(2);
  check_num_tags(T);
  Status status(marginals);
  auto grad_emissions = torch::stable::empty_like(marginals);
  auto grad_transitions = empty({T, T}, options_of(marginals));
  auto grad_start = empty({T}, options_of(marginals));
  auto grad_end = empty({T}, options_of(marginals));
  const cudaStream_t stream = current_stream();
  CRFKIT_DISPATCH_FLOATING_TYPES(marginals.scalar_type(), "crfkit_log_partition_backward_from_marginals_cuda", [&] {
    const int64_t elements = B * L * T;
    if (elements > 0) {
      scale_marginals_kernel<scalar_t><<<elementwise_blocks(elements), kElementwiseThreads, 0, stream>>>(
          grad_log_z.mutable_data_ptr<scalar_t>(), marginals.mutable_data_ptr<scalar_t>(), lengths.mutable_data_ptr<int64_t>(),
          grad_emissions.mutable_data_ptr<scalar_t>(), B, L, T);
      CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
    }
    // The lengths' range (there are no parameters here), checked by the second kernel.
    launch_sum_parameter_grads<scalar_t>(grad_log_z, marginals, counts, lengths, grad_transitions, grad_start,
                                         grad_end, input_checks_of<scalar_t>(lengths, L, {}, {}, {}, status));
  });
  status.raise_if_bad(lengths, L);
  return {grad_emissions, grad_transitions, grad_start, grad_end};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(crfkit, CUDA, m) {
  m.impl("log_partition", TORCH_BOX(&log_partition_cuda));
  m.impl("marginals", TORCH_BOX(&marginals_cuda));
  m.impl("log_partition_backward", TORCH_BOX(&log_partition_backward_cuda));
  m.impl("log_partition_with_marginals", TORCH_BOX(&log_partition_with_marginals_cuda));
  m.impl("log_partition_backward_from_marginals", TORCH_BOX(&log_partition_backward_from_marginals_cuda));
  m.impl("expected_transition_counts", TORCH_BOX(&expected_transition_counts_cuda));
}

}  // namespace cuda
}  // namespace crfkit
