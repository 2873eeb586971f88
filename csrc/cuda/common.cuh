// Shared pieces of the CUDA kernels: argument checks, the status words that carry
// data-dependent errors back to the host, numeric helpers, group reductions and the launch
// layout every per-sentence kernel uses.
//
// Thread layout (log Z, marginals, Viterbi, k-best): one GROUP of G lanes per sentence,
// G = min(next power of two >= T, 32), so a group never spans two warps and every
// synchronisation inside the time loop is a __syncwarp or a shuffle, never a block barrier.
// Lane l owns the tags t = l, l + G, l + 2G, ... (loops over tags: any T works). Blocks hold
// 1..4 warps and are PERSISTENT: the grid is at most what is resident on the device and each
// group walks over sentences b = first, first + groups in grid, ... (so B is not limited by the
// grid size, and per-group workspaces are sized by the grid, not by B). All groups of a warp
// run the time loop to the longest sentence of the warp, predicated off past their own length,
// so the warp stays converged and __syncwarp() with the full mask is always legal.
//
// Errors that depend on the data (lengths out of range, NaN / +inf scores, bad tags) are
// detected on the device while the kernels run: the first offending index is recorded with
// atomicMin in a few int64 status words, and the host reads them back once after the launch
// (one synchronisation per op) and raises the same messages as the CPU kernels. The kernels
// never read out of bounds on bad data (bad lengths count as 0, bad tags are not followed,
// backtraces stop at an out-of-range code), so a bad call raises instead of crashing.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>  // DeviceGuard

#include "../backpointers.h"
#include "../checks.h"
#include "../numerics.h"  // trusted_sum_min, pairwise_fast_bound (shared with the CPU kernels)
#include "../tensor.h"

// The current CUDA stream of a device, from torch's C shim (libtorch_cuda exports it). shim.h
// declares it only under USE_CUDA, which an extension's build does not define: the same
// declaration, here. (Stream::nativeHandle in torch/csrc/stable/accelerator.h is 2.13-only.)
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index,
                                                                              void** ret_stream);

// A failed CUDA runtime call (or, after a launch, cudaGetLastError) throws std::runtime_error
// naming the call and CUDA's message (RuntimeError in Python), as c10's C10_CUDA_CHECK did.
#define CRFKIT_CUDA_CHECK(expr)                                                             \
  do {                                                                                      \
    const cudaError_t crfkit_cuda_error_ = (expr);                                          \
    if (crfkit_cuda_error_ != cudaSuccess) [[unlikely]] {                                   \
      throw std::runtime_error(std::string("crfkit: CUDA error: ") +                         \
                               cudaGetErrorString(crfkit_cuda_error_) + " (" #expr ")");    \
    }                                                                                       \
  } while (false)
// After a kernel launch: a bad launch configuration (or an earlier asynchronous error).
#define CRFKIT_CUDA_KERNEL_LAUNCH_CHECK() CRFKIT_CUDA_CHECK(cudaGetLastError())

namespace crfkit {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr int kMaxWarpsPerBlock = 4;
constexpr int kMaxThreadsPerBlock = kWarpSize * kMaxWarpsPerBlock;
// Dynamic shared memory one block may use without opting in (every architecture since sm_35).
// Buffers that do not fit go to global memory (cached in L1 / L2) instead; see plan_shared.
constexpr size_t kSharedBudget = 48 * 1024;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- status words ------------------------------------------------------------------------
// Each word holds the smallest offending index found (atomicMin), INT64_MAX when none.
enum StatusWord : int {
  kBadLength = 0,       // sentence index b with lengths[b] outside [0, L]
  kBadTransitions = 1,  // flat index of a NaN / +inf transition
  kBadStart = 2,
  kBadEnd = 3,
  kBadTag = 4,          // flat index (b * N + j) * L + i of a tag outside [0, T)
  kBadEmissions = 5,    // sentence index b with NaN / +inf emissions within its length
  kBadNoise = 6,        // sentence index b with non-finite sampler noise within its length
  kNumStatusWords = 7,
};
constexpr int64_t kStatusClear = std::numeric_limits<int64_t>::max();

__device__ __forceinline__ void report(long long* status, StatusWord word, int64_t index) {
  atomicMin(status + word, static_cast<long long>(index));
}

// Device-side error reporting of one op: the words the kernels fill, then the check.
//
// Two modes. Checked (the default): a fresh set of words per call, read back after the launch
// (one wait for the GPU), raising at once. Deferred (crfkit.deferred_errors(), and always while
// a CUDA graph is being captured, where nothing can be read back): the kernels report into one
// persistent set of words per device, nothing is copied to the host, and crfkit.check_errors()
// raises what was recorded since the last check. A deferred call on bad input returns
// meaningless values (the kernels stay memory-safe) until that check.
class Status {
 public:
  explicit Status(const Tensor& like);

  long long* data() { return reinterpret_cast<long long*>(words_.mutable_data_ptr<int64_t>()); }

  // Whether one of the op's kernels runs the input checks (input_checks below); checked_launch
  // launches the standalone check otherwise.
  bool inputs_checked() const { return inputs_checked_; }
  void note_inputs_checked() { inputs_checked_ = true; }

  // Checked mode: copies the words to the host (one synchronisation) and raises the first error
  // in the order the CPU kernels check: lengths, transitions, start, end, tags, emissions, noise.
  // Deferred mode: returns at once.
  // `lengths` / `tags` (may be undefined) give the values quoted in the messages.
  void raise_if_bad(const Tensor& lengths, int64_t max_len, const Tensor& tags = {},
                    int64_t num_tags = 0) const;

 private:
  bool deferred_;
  bool inputs_checked_ = false;
  Tensor words_;
};

// lengths[b] in [0, L] and transitions / start / end free of NaN / +inf (any of the three may
// be null, e.g. for sequence_score_backward, which has none). One small grid-stride kernel, for
// ops whose kernels do not run input_checks themselves.
void launch_validate_inputs(const Tensor& lengths, int64_t max_len, const Tensor& transitions,
                            const Tensor& start, const Tensor& end, Status& status);

// Emissions (B, L, T) free of NaN / +inf within each sentence's length; for ops that do not
// read every emission themselves (sequence_score).
void launch_check_emissions(const Tensor& emissions, const Tensor& lengths, Status& status);

// Parallel in time (forward_backward_chunked.cuh, viterbi_chunked.cuh): the chunk length S for a call on (B, L, T)
// with `lanes` lanes per group, or 0 for the sequential kernels. Set by the environment
// (CRFKIT_CUDA_TIME_PARALLEL = auto / always / never, CRFKIT_CUDA_TIME_CHUNK = S; common.cu).
int64_t time_chunk_length(int64_t B, int64_t L, int64_t T, int lanes);

// log Z (B,) for CRF arguments checked by checked_cuda_args, their values checked into `status`
// (input_checks) unless another kernel of the op has; launched on the current stream, the caller raises
// (log_partition.cu; used by kbest_viterbi_with_log_probs in kbest.cu).
Tensor launch_log_partition(const CrfArgs& a, Status& status);

// ---- arguments -----------------------------------------------------------------------------
// What launch_validate_inputs checks, run instead by the first kernel of an op before its own
// work (check_inputs, below): a call then queues one launch fewer, and at small batch launches
// are most of a call's host time.
// `status` null: this launch checks nothing (no kernel of the op has taken the checks yet, or
// another already has).
template <typename scalar_t>
struct InputChecks {
  const int64_t* lengths = nullptr;      // (batch,): each in [0, max_len]
  const scalar_t* transitions = nullptr;  // (T, T), start (T,), end (T,): free of NaN / +inf
  const scalar_t* start = nullptr;        // (or per example: (B, Lt, T, T), (B, T), (B, T))
  const scalar_t* end = nullptr;
  long long* status = nullptr;
  int64_t batch = 0, max_len = 0;
  int64_t transitions_count = 0, parameter_count = 0;  // elements of transitions, of start (= of end)
};

// The checks of lengths (B,) against max_len and of transitions / start / end, any of which may
// be undefined (not checked), reporting into `status`.
template <typename scalar_t>
InputChecks<scalar_t> input_checks_of(const Tensor& lengths, int64_t max_len, const Tensor& transitions,
                                      const Tensor& start, const Tensor& end, Status& status) {
  auto pointer = [](const Tensor& x) { return x.defined() ? x.mutable_data_ptr<scalar_t>() : nullptr; };
  InputChecks<scalar_t> c;
  c.lengths = lengths.mutable_data_ptr<int64_t>();
  c.transitions = pointer(transitions);
  c.start = pointer(start);
  c.end = pointer(end);
  c.status = status.data();
  c.batch = lengths.size(0);
  c.max_len = max_len;
  c.transitions_count = transitions.defined() ? transitions.numel() : 0;
  c.parameter_count = start.defined() ? start.numel() : 0;
  return c;
}

// The checks of `a` for the op's first kernel that takes them, recorded in `status`; an empty
// InputChecks where a kernel of this op already has them.
template <typename scalar_t>
InputChecks<scalar_t> input_checks(const CrfArgs& a, Status& status) {
  if (status.inputs_checked()) return {};
  status.note_inputs_checked();
  return input_checks_of<scalar_t>(a.lengths, a.emissions.size(1), a.transitions, a.start, a.end, status);
}

// Fills what every launch's parameter struct (FbParams, ChunkParams, ViterbiChunkParams,
// DecodeParams) has: the CRF arguments' pointers, the status words and the sizes.
template <typename scalar_t, typename Params>
void set_crf_arguments(Params& p, const CrfArgs& a, Status& status) {
  p.emissions = a.emissions.mutable_data_ptr<scalar_t>();
  p.transitions = a.transitions.mutable_data_ptr<scalar_t>();
  p.start = a.start.mutable_data_ptr<scalar_t>();
  p.end = a.end.mutable_data_ptr<scalar_t>();
  p.lengths = a.lengths.mutable_data_ptr<int64_t>();
  p.status = status.data();
  p.batch = a.emissions.size(0);
  p.max_len = a.emissions.size(1);
  p.num_tags = (int)a.emissions.size(2);
}

// The CRF arguments of a CUDA op, dense and shape-checked (values are checked on the device):
// shared transitions (T, T) with start, end (T,) or, where `per_example` (the kernels of
// per_example.cu), transitions (B, Lt, T, T) with start, end (B, T).
inline CrfArgs checked_cuda_args(const Tensor& emissions, const Tensor& transitions,
                                 const Tensor& lengths, const Tensor& start,
                                 const Tensor& end, bool per_example = false) {
  CrfArgs a{as_contiguous(emissions), as_contiguous(transitions), as_contiguous(lengths), as_contiguous(start),
            as_contiguous(end)};
  if (per_example) {
    check_per_example_inputs(a.emissions, a.transitions, a.lengths, a.start, a.end);
  } else {
    check_not_per_example(a.transitions, "transitions", "this CUDA kernel");
    check_crf_inputs(a.emissions, a.transitions, a.lengths, a.start, a.end);
  }
  CRFKIT_CHECK(a.emissions.is_cuda(), "crfkit: the CUDA kernels take CUDA tensors, got emissions on ",
              a.emissions.device());
  return a;
}

// The frame of an op on CRF arguments: checks them, runs launch(a, status) (which queues the
// op's kernels, the first of which usually checks the values too: input_checks), launches the
// standalone value check where none did, then raises from the status words (one read back to
// the host, which waits for the kernels) and returns launch's outputs. per_example: the
// arguments are per example (per_example.cu's launches).
template <typename Launch>
auto checked_launch(const Tensor& emissions, const Tensor& transitions, const Tensor& lengths,
                    const Tensor& start, const Tensor& end, Launch&& launch, bool per_example = false) {
  const CrfArgs a = checked_cuda_args(emissions, transitions, lengths, start, end, per_example);
  const torch::stable::accelerator::DeviceGuard guard(a.emissions.get_device_index());
  Status status(a.emissions);
  auto outputs = launch(a, status);
  if (!status.inputs_checked()) {
    launch_validate_inputs(a.lengths, a.emissions.size(1), a.transitions, a.start, a.end, status);
  }
  status.raise_if_bad(a.lengths, a.emissions.size(1));
  return outputs;
}

// ---- numerics ------------------------------------------------------------------------------
template <typename scalar_t>
__device__ __forceinline__ scalar_t neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() { return -CUDART_INF_F; }
template <>
__device__ __forceinline__ double neg_inf<double>() { return -CUDART_INF; }

template <typename scalar_t>
__device__ __forceinline__ bool is_nan_or_pos_inf(scalar_t v) {
  return (v != v) || (v == -neg_inf<scalar_t>());
}

// The input checks as a grid-stride loop over every thread of a 1-D grid (any grid: a thread
// checks the entries idx, idx + threads in grid, ...). Kernels run it first, by every thread,
// before any early return; it reads the inputs only, so no barrier follows it.
template <typename scalar_t>
__device__ __forceinline__ void check_inputs(const InputChecks<scalar_t>& c) {
  if (c.status == nullptr) return;
  const int64_t count = c.batch > c.transitions_count ? c.batch : c.transitions_count;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < count;
       idx += (int64_t)gridDim.x * blockDim.x) {
    if (idx < c.batch) {
      const int64_t n = c.lengths[idx];
      if (n < 0 || n > c.max_len) report(c.status, kBadLength, idx);
    }
    if (c.transitions != nullptr && idx < c.transitions_count && is_nan_or_pos_inf(c.transitions[idx])) {
      report(c.status, kBadTransitions, idx);
    }
    const bool parameter = idx < c.parameter_count;
    if (c.start != nullptr && parameter && is_nan_or_pos_inf(c.start[idx])) report(c.status, kBadStart, idx);
    if (c.end != nullptr && parameter && is_nan_or_pos_inf(c.end[idx])) report(c.status, kBadEnd, idx);
  }
}

// Length of sentence b, 0 when out of range (check_inputs reports that, and the op raises once
// the kernels are done).
__device__ __forceinline__ int64_t safe_length(const int64_t* lengths, int64_t b, int64_t max_len) {
  const int64_t n = lengths[b];
  return (n < 0 || n > max_len) ? 0 : n;
}

// The precise library functions (no fast-math): exp(-inf) = 0, log(0) = -inf.
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return ::exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return ::log(x); }

template <typename scalar_t>
__device__ __forceinline__ scalar_t max_(scalar_t a, scalar_t b) { return b > a ? b : a; }

// ---- group reductions (G lanes, G a power of two <= 32) --------------------------------------
// Every lane of the WARP must call these (the shuffles use the full mask); with width G each
// group of G lanes reduces on its own. The xor butterfly leaves the identical result in every
// lane of the group (additions are commutative), so the results are group-uniform.
template <typename V>
__device__ __forceinline__ V group_max(V v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) {
    const V other = __shfl_xor_sync(kFullMask, v, offset, lanes);
    v = other > v ? other : v;
  }
  return v;
}

template <typename V>
__device__ __forceinline__ V group_sum(V v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset, lanes);
  return v;
}

// (value, index) of the maximum; among equal values the smallest index wins, which is what a
// sequential scan in ascending index with a strict '>' returns (the CPU kernels' tie rule).
template <typename scalar_t>
__device__ __forceinline__ void group_argmax(scalar_t& value, int& index, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) {
    const scalar_t other_value = __shfl_xor_sync(kFullMask, value, offset, lanes);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset, lanes);
    if (other_value > value || (other_value == value && other_index < index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// Longest sentence of the warp: the trip count of its time loop.
__device__ __forceinline__ int64_t warp_max(int64_t v) { return group_max(v, kWarpSize); }

// ---- launch layout --------------------------------------------------------------------------
// Lanes per sentence: the smallest power of two >= T, at most a warp.
inline int lanes_per_sentence(int64_t num_tags) {
  int lanes = 1;
  while (lanes < num_tags && lanes < kWarpSize) lanes *= 2;
  return lanes;
}

__host__ __device__ inline size_t align_up(size_t bytes, size_t to = 16) {
  return (bytes + to - 1) / to * to;
}

// Where a kernel's buffers live. Per-group buffers ("arenas": alpha, lists, ...) first: they
// are in the innermost loops. Then an optional per-group accumulator, then the block-wide
// read-only tables. Whatever does not fit in kSharedBudget lives in global memory (a
// per-group slice of a workspace tensor), reached through the same generic pointers.
struct SharedPlan {
  int lanes = 1;            // G
  int threads = kWarpSize;  // warps per block * 32
  int groups_per_block = 1;
  bool arena_in_shared = true;
  bool accumulator_in_shared = true;
  bool tables_in_shared = true;
  size_t shared_bytes = 0;  // dynamic shared memory of one block
};

inline SharedPlan plan_shared(int64_t num_tags, size_t arena_bytes, size_t accumulator_bytes,
                              size_t table_bytes) {
  SharedPlan plan;
  plan.lanes = lanes_per_sentence(num_tags);
  int warps = kMaxWarpsPerBlock;
  // Fewer warps per block before giving up shared memory for the arenas.
  while (warps > 1 && (size_t)(warps * kWarpSize / plan.lanes) * arena_bytes > kSharedBudget) warps /= 2;
  plan.threads = warps * kWarpSize;
  plan.groups_per_block = plan.threads / plan.lanes;
  size_t used = 0;
  const size_t arenas = plan.groups_per_block * align_up(arena_bytes);
  plan.arena_in_shared = arenas <= kSharedBudget;
  if (plan.arena_in_shared) used += arenas;
  const size_t accumulators = plan.groups_per_block * align_up(accumulator_bytes);
  plan.accumulator_in_shared = accumulator_bytes > 0 && used + accumulators <= kSharedBudget;
  if (plan.accumulator_in_shared) used += accumulators;
  plan.tables_in_shared = table_bytes > 0 && used + align_up(table_bytes) <= kSharedBudget;
  if (plan.tables_in_shared) used += align_up(table_bytes);
  plan.shared_bytes = used;
  return plan;
}

// A kernel runs in one of two variants, chosen on the host by all_in_shared(plan):
//   kAllShared = true   every buffer the plan places is in shared memory (small T: the common
//                       case). The helpers below then never select a global pointer, so the
//                       compiler knows each buffer pointer is a shared one and emits shared-memory
//                       loads with 32-bit addresses (LDS) instead of generic loads with 64-bit
//                       address arithmetic: the per-position loops are mostly such loads.
//   kAllShared = false  buffers may be in global memory (per plan flag); generic pointers.
inline bool all_in_shared(const SharedPlan& plan, bool has_accumulator) {
  return plan.arena_in_shared && plan.tables_in_shared && (!has_accumulator || plan.accumulator_in_shared);
}

// Device side of a SharedPlan: the group's arena (in shared memory or its slice of the global
// workspace); `cursor` moves past the block's arenas when they are in shared memory.
template <bool kAllShared>
__device__ __forceinline__ unsigned char* group_arena(unsigned char*& cursor, const SharedPlan& plan,
                                                      size_t arena_bytes, unsigned char* workspace,
                                                      int group, int64_t slot) {
  if (!kAllShared && !plan.arena_in_shared) return workspace + slot * arena_bytes;
  unsigned char* arena = cursor + group * arena_bytes;
  cursor += plan.groups_per_block * arena_bytes;
  return arena;
}

// A read-only table for the whole block: copied to shared memory at `cursor` when the plan
// says so (the caller then needs one __syncthreads), else read where it is.
template <bool kAllShared, typename scalar_t>
__device__ __forceinline__ const scalar_t* stage_table(unsigned char*& cursor, bool in_shared,
                                                       const scalar_t* table, int64_t count) {
  if (!kAllShared && !in_shared) return table;
  scalar_t* copy = reinterpret_cast<scalar_t*>(cursor);
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) copy[k] = table[k];
  cursor += align_up(count * sizeof(scalar_t));
  return copy;
}

// An attribute of the current device (cudaDevAttrMultiProcessorCount, ...).
inline int current_device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  CRFKIT_CUDA_CHECK(cudaGetDevice(&device));
  CRFKIT_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

// Blocks of a persistent launch: enough for every sentence, at most what the device holds at
// once (so that per-group workspaces stay bounded), at most max_blocks. At least 1.
template <typename Kernel>
int64_t persistent_blocks(Kernel kernel, const SharedPlan& plan, int64_t num_sentences,
                          int64_t max_blocks = std::numeric_limits<int64_t>::max()) {
  const int multiprocessors = current_device_attribute(cudaDevAttrMultiProcessorCount);
  int per_multiprocessor = 0;
  CRFKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, plan.threads,
                                                               plan.shared_bytes));
  const int64_t resident = std::max<int64_t>(1, (int64_t)per_multiprocessor * multiprocessors);
  const int64_t needed = (num_sentences + plan.groups_per_block - 1) / plan.groups_per_block;
  return std::max<int64_t>(1, std::min({needed, resident, max_blocks}));
}

// Blocks of `threads` for a grid-stride loop over `count` items: one item per thread, at most
// max_blocks blocks (the loop covers the rest). At least 1.
inline int64_t grid_stride_blocks(int64_t count, int threads, int64_t max_blocks) {
  return std::max<int64_t>(1, std::min(max_blocks, (count + threads - 1) / threads));
}

// The current stream of the current device (which the op's DeviceGuard has set): torch's, so
// that the kernels are ordered with the caller's work and captured into its CUDA graphs.
inline cudaStream_t current_stream() {
  int device = 0;
  CRFKIT_CUDA_CHECK(cudaGetDevice(&device));
  void* stream = nullptr;
  CRFKIT_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
               "crfkit: could not get the current CUDA stream of device ", device);
  return static_cast<cudaStream_t>(stream);
}

}  // namespace cuda
}  // namespace crfkit
