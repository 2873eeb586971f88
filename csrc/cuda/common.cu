// Device-side validation of the data every op reads, and the host side that turns the status
// words into the CPU kernels' error messages (see common.cuh).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator ATen headers only (README, Layout)

#include "common.cuh"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace crfkit {
namespace cuda {
namespace {

constexpr int kValidateThreads = 256;
constexpr int64_t kMaxValidateBlocks = 1024;  // grid-stride loops cover the rest

// lengths (B,) int64 within [0, L]; transitions (T*T), start, end (T) free of NaN / +inf.
// Null parameter pointers are skipped.
template <typename scalar_t>
__global__ void validate_inputs_kernel(const InputChecks<scalar_t> checks) {
  check_inputs(checks);
}

// emissions (B, L, T): the first sentence with NaN / +inf at a position below its length.
// Flat grid-stride loop (coalesced reads); a sentence with an invalid length is skipped (that
// error is reported by check_inputs and takes precedence).
template <typename scalar_t>
__global__ void check_emissions_kernel(const scalar_t* emissions, const int64_t* lengths, int64_t batch,
                                       int64_t max_len, int64_t num_tags, long long* status) {
  const int64_t per_sentence = max_len * num_tags;
  const int64_t count = batch * per_sentence;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < count;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = idx / per_sentence;
    const int64_t position = (idx - b * per_sentence) / num_tags;
    const int64_t n = lengths[b];
    if (n >= 0 && n <= max_len && position < n && is_nan_or_pos_inf(emissions[idx])) {
      report(status, kBadEmissions, b);
    }
  }
}

int64_t grid_for(int64_t count) { return grid_stride_blocks(count, kValidateThreads, kMaxValidateBlocks); }

}  // namespace

void launch_validate_inputs(const at::Tensor& lengths, int64_t max_len, const at::Tensor& transitions,
                            const at::Tensor& start, const at::Tensor& end, Status& status) {
  const int64_t num_tags = transitions.defined() ? transitions.size(0) : 0;
  const int64_t count = std::max(lengths.size(0), num_tags * num_tags);
  if (count == 0) return;
  const auto type = transitions.defined() ? transitions.scalar_type() : at::kFloat;
  AT_DISPATCH_FLOATING_TYPES(type, "crfkit_validate_inputs", [&] {
    validate_inputs_kernel<scalar_t><<<grid_for(count), kValidateThreads, 0, current_stream()>>>(
        input_checks_of<scalar_t>(lengths, max_len, transitions, start, end, status));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_check_emissions(const at::Tensor& emissions, const at::Tensor& lengths, Status& status) {
  const int64_t count = emissions.numel();
  if (count == 0) return;
  AT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_check_emissions", [&] {
    check_emissions_kernel<scalar_t><<<grid_for(count), kValidateThreads, 0, current_stream()>>>(
        emissions.data_ptr<scalar_t>(), lengths.data_ptr<int64_t>(), emissions.size(0), emissions.size(1),
        emissions.size(2), status.data());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The parallel-in-time path's settings (see time_chunk_length in common.cuh):
// CRFKIT_CUDA_TIME_PARALLEL =
//   auto    (the default) chunks for sentences of at least kMinChunkedLength positions when the
//           batch is too small to fill the GPU: B * C * T groups of phase 1 at most what the device
//           holds at once (beyond that the chunked path's extra work outweighs its shorter time
//           loop; below 128 positions its extra launches cost more than the shorter loop saves;
//           timings in benchmarks/results/gpu_time_parallel_h200.md and _small_h200.md);
//   always  chunks wherever the register kernel applies (the tests use it);
//   never   the sequential kernels only.
// CRFKIT_CUDA_TIME_CHUNK = S sets the chunk length (default ceil(sqrt(2 L))).
namespace {
constexpr int64_t kMinChunkedLength = 128;

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* rest = nullptr;
  const long long parsed = std::strtoll(value, &rest, 10);
  TORCH_CHECK_VALUE(*rest == '\0' && parsed > 0, "crfkit: the environment variable ", name,
                    " must be a positive integer, got '", value, "'");
  return parsed;
}

}  // namespace

int64_t time_chunk_length(int64_t B, int64_t L, int64_t T, int lanes) {
  const char* mode = std::getenv("CRFKIT_CUDA_TIME_PARALLEL");
  const bool always = mode != nullptr && std::strcmp(mode, "always") == 0;
  const bool never = mode != nullptr && std::strcmp(mode, "never") == 0;
  TORCH_CHECK_VALUE(mode == nullptr || *mode == '\0' || always || never || std::strcmp(mode, "auto") == 0,
                    "crfkit: the environment variable CRFKIT_CUDA_TIME_PARALLEL must be auto, always or never, "
                    "got '", mode, "'");
  const int64_t S = std::min<int64_t>(std::max<int64_t>(L, 1),
                                      env_int("CRFKIT_CUDA_TIME_CHUNK", (int64_t)std::ceil(std::sqrt(2.0 * L))));
  if (never || B == 0 || L == 0) return 0;
  if (always) return S;
  if (L < kMinChunkedLength) return 0;
  const int64_t resident_groups = (int64_t)current_device_attribute(cudaDevAttrMultiProcessorCount) *
                                  current_device_attribute(cudaDevAttrMaxThreadsPerMultiProcessor) / lanes;
  return B * ((L + S - 1) / S) * T <= resident_groups ? S : 0;
}


// ---- checked and deferred modes -----------------------------------------------------------
namespace {

std::atomic<bool> deferred_mode{false};

// The persistent words of deferred mode, one set per device, made on first use. (Made during a
// capture, their fill is part of the graph and clears them at each replay; a warm-up call
// before capturing, which CUDA graphs need anyway, makes them outside.)
std::mutex deferred_mutex;
std::map<int, at::Tensor> deferred_words;

at::Tensor deferred_words_for(const at::Tensor& like) {
  const std::lock_guard<std::mutex> lock(deferred_mutex);
  at::Tensor& words = deferred_words[like.device().index()];
  if (!words.defined()) words = at::full({kNumStatusWords}, kStatusClear, like.options().dtype(at::kLong));
  return words;
}

}  // namespace

Status::Status(const at::Tensor& like)
    : deferred_(deferred_mode.load(std::memory_order_relaxed) ||
                c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None),
      words_(deferred_ ? deferred_words_for(like)
                       : at::full({kNumStatusWords}, kStatusClear, like.options().dtype(at::kLong))) {}

void Status::raise_if_bad(const at::Tensor& lengths, int64_t max_len, const at::Tensor& tags,
                          int64_t num_tags) const {
  if (deferred_) return;
  const at::Tensor host = words_.to(at::kCPU);  // waits for the kernels of this op
  const int64_t* word = host.data_ptr<int64_t>();
  if (word[kBadLength] != kStatusClear) {
    const int64_t b = word[kBadLength];
    TORCH_CHECK_VALUE(false, "crfkit: lengths[", b, "] = ", lengths[b].item<int64_t>(),
                      " is outside [0, seq_len = ", max_len, "]");
  }
  TORCH_CHECK_VALUE(word[kBadTransitions] == kStatusClear,
                    "crfkit: transitions contains NaN or +inf (use -inf to forbid a transition)");
  TORCH_CHECK_VALUE(word[kBadStart] == kStatusClear,
                    "crfkit: start contains NaN or +inf (use -inf to forbid a first tag)");
  TORCH_CHECK_VALUE(word[kBadEnd] == kStatusClear,
                    "crfkit: end contains NaN or +inf (use -inf to forbid a last tag)");
  if (word[kBadTag] != kStatusClear && tags.defined()) {
    const int64_t flat = word[kBadTag];
    const int64_t per_sentence = tags.size(1) * tags.size(2);
    const int64_t b = flat / per_sentence, j = (flat % per_sentence) / tags.size(2), i = flat % tags.size(2);
    TORCH_CHECK_VALUE(false, "crfkit: tags[", b, ", ", j, ", ", i, "] = ", tags[b][j][i].item<int64_t>(),
                      " is not a tag index in [0, ", num_tags, ")");
  }
  TORCH_CHECK_VALUE(word[kBadEmissions] == kStatusClear, "crfkit: emissions[", word[kBadEmissions],
                    "] contains NaN or +inf within its length (use -inf to forbid a tag)");
}

}  // namespace cuda
}  // namespace crfkit

// The mode switch and the check, as C functions: crfkit/backends/deferred_errors.py reaches them
// with ctypes in crfkit._C and, the same way, in the CUDA emulator's library (which has no
// Python module of its own). The messages are made there.
extern "C" {

// Sets deferred mode on (1) or off (0); returns the previous mode.
__attribute__((visibility("default"))) int crfkit_cuda_set_deferred_errors(int enabled) {
  return crfkit::cuda::deferred_mode.exchange(enabled != 0) ? 1 : 0;
}

// Reads the deferred words of every device (waiting for each), clears them, and copies the words
// of the first device that recorded an error to out[0..5] and its index to *device. Returns 1 if
// an error was recorded, 0 if none, -1 if the read itself failed (a CUDA error).
__attribute__((visibility("default"))) int crfkit_cuda_take_deferred_errors(long long* out, int* device) {
  using namespace crfkit::cuda;
  try {
    const std::lock_guard<std::mutex> lock(deferred_mutex);
    int found = 0;
    for (auto& [index, words] : deferred_words) {
      const at::Tensor host = words.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
      words.fill_(kStatusClear);
      const int64_t* word = host.data_ptr<int64_t>();
      bool bad = false;
      for (int i = 0; i < kNumStatusWords; ++i) bad = bad || word[i] != kStatusClear;
      if (bad && !found) {
        for (int i = 0; i < kNumStatusWords; ++i) out[i] = word[i];
        *device = index;
        found = 1;
      }
    }
    return found;
  } catch (const std::exception&) {
    return -1;
  }
}

}  // extern "C"
