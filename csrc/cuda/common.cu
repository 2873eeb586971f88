// Device-side validation of the data every op reads, and the host side that turns the status
// words into the CPU kernels' error messages (see common.cuh).
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

void launch_validate_inputs(const Tensor& lengths, int64_t max_len, const Tensor& transitions,
                            const Tensor& start, const Tensor& end, Status& status) {
  const int64_t count = std::max(lengths.size(0), transitions.defined() ? transitions.numel() : 0);
  if (count == 0) return;
  const auto type = transitions.defined() ? transitions.scalar_type() : kFloat;
  CRFKIT_DISPATCH_FLOATING_TYPES(type, "crfkit_validate_inputs", [&] {
    validate_inputs_kernel<scalar_t><<<grid_for(count), kValidateThreads, 0, current_stream()>>>(
        input_checks_of<scalar_t>(lengths, max_len, transitions, start, end, status));
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_check_emissions(const Tensor& emissions, const Tensor& lengths, Status& status) {
  const int64_t count = emissions.numel();
  if (count == 0) return;
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_check_emissions", [&] {
    check_emissions_kernel<scalar_t><<<grid_for(count), kValidateThreads, 0, current_stream()>>>(
        emissions.mutable_data_ptr<scalar_t>(), lengths.mutable_data_ptr<int64_t>(), emissions.size(0), emissions.size(1),
        emissions.size(2), status.data());
    CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
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
  CRFKIT_CHECK_VALUE(*rest == '\0' && parsed > 0, "crfkit: the environment variable ", name,
                    " must be a positive integer, got '", value, "'");
  return parsed;
}

}  // namespace

int64_t time_chunk_length(int64_t B, int64_t L, int64_t T, int lanes) {
  const char* mode = std::getenv("CRFKIT_CUDA_TIME_PARALLEL");
  const bool always = mode != nullptr && std::strcmp(mode, "always") == 0;
  const bool never = mode != nullptr && std::strcmp(mode, "never") == 0;
  CRFKIT_CHECK_VALUE(mode == nullptr || *mode == '\0' || always || never || std::strcmp(mode, "auto") == 0,
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

// The cleared words (kStatusClear each) on a device, made once per device from a host copy and
// then copied (device to device, on the stream) into each fresh or re-cleared set of words. The
// stable ABI fills tensors with a double only, and a double cannot hold INT64_MAX. Made on the
// first call on a device, which must not be under a CUDA graph capture (a warm-up call, which
// CUDA graphs need anyway, makes them outside).
std::mutex clear_mutex;
std::map<int, Tensor> clear_words;

Tensor clear_words_for(const Tensor& like) {
  const std::lock_guard<std::mutex> lock(clear_mutex);
  Tensor& words = clear_words[like.get_device_index()];
  if (!words.defined()) {
    Tensor host = empty({kNumStatusWords}, TensorOptions{kLong, Device(torch::headeronly::DeviceType::CPU)});
    int64_t* word = host.mutable_data_ptr<int64_t>();
    for (int i = 0; i < kNumStatusWords; ++i) word[i] = kStatusClear;
    words = torch::stable::to(host, like.device());
  }
  return words;
}

// A fresh set of cleared words on the device of `like`.
Tensor fresh_words(const Tensor& like) { return torch::stable::clone(clear_words_for(like)); }

// The persistent words of deferred mode, one set per device, made on first use. (Made during a
// capture, their fill is part of the graph and clears them at each replay; a warm-up call
// before capturing, which CUDA graphs need anyway, makes them outside.)
std::mutex deferred_mutex;
std::map<int, Tensor> deferred_words;

Tensor deferred_words_for(const Tensor& like) {
  const std::lock_guard<std::mutex> lock(deferred_mutex);
  Tensor& words = deferred_words[like.get_device_index()];
  if (!words.defined()) words = fresh_words(like);
  return words;
}

// Whether the current stream is being captured into a CUDA graph (nothing can be read back then).
bool capturing() {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CRFKIT_CUDA_CHECK(cudaStreamIsCapturing(current_stream(), &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// Element `index` of an int64 tensor, read on the host (error messages only).
int64_t host_value(const Tensor& t, int64_t index) {
  const Tensor host = torch::stable::to(as_contiguous(t), Device(torch::headeronly::DeviceType::CPU));
  return host.mutable_data_ptr<int64_t>()[index];
}

}  // namespace

Status::Status(const Tensor& like)
    : deferred_(deferred_mode.load(std::memory_order_relaxed) || capturing()),
      words_(deferred_ ? deferred_words_for(like) : fresh_words(like)) {}

void Status::raise_if_bad(const Tensor& lengths, int64_t max_len, const Tensor& tags,
                          int64_t num_tags) const {
  if (deferred_) return;
  // Waits for the kernels of this op.
  const Tensor host = torch::stable::to(words_, Device(torch::headeronly::DeviceType::CPU));
  const int64_t* word = host.mutable_data_ptr<int64_t>();
  if (word[kBadLength] != kStatusClear) {
    const int64_t b = word[kBadLength];
    CRFKIT_CHECK_VALUE(false, "crfkit: lengths[", b, "] = ", host_value(lengths, b),
                       " is outside [0, seq_len = ", max_len, "]");
  }
  CRFKIT_CHECK_VALUE(word[kBadTransitions] == kStatusClear,
                     "crfkit: transitions contains NaN or +inf (use -inf to forbid a transition)");
  CRFKIT_CHECK_VALUE(word[kBadStart] == kStatusClear,
                     "crfkit: start contains NaN or +inf (use -inf to forbid a first tag)");
  CRFKIT_CHECK_VALUE(word[kBadEnd] == kStatusClear,
                     "crfkit: end contains NaN or +inf (use -inf to forbid a last tag)");
  if (word[kBadTag] != kStatusClear && tags.defined()) {
    const int64_t flat = word[kBadTag];  // (b * N + j) * L + i: the flat index of (b, j, i)
    const int64_t per_sentence = tags.size(1) * tags.size(2);
    const int64_t b = flat / per_sentence, j = (flat % per_sentence) / tags.size(2), i = flat % tags.size(2);
    CRFKIT_CHECK_VALUE(false, "crfkit: tags[", b, ", ", j, ", ", i, "] = ", host_value(tags, flat),
                       " is not a tag index in [0, ", num_tags, ")");
  }
  CRFKIT_CHECK_VALUE(word[kBadEmissions] == kStatusClear, "crfkit: emissions[", word[kBadEmissions],
                     "] contains NaN or +inf within its length (use -inf to forbid a tag)");
  CRFKIT_CHECK_VALUE(word[kBadNoise] == kStatusClear, "crfkit: noise[:, ", word[kBadNoise],
                     "] contains NaN or +-inf within the sentence's length (noise holds standard Gumbels)");
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
      const crfkit::Tensor host = torch::stable::to(words, crfkit::Device(torch::headeronly::DeviceType::CPU),
                                                    /*non_blocking=*/false, /*copy=*/true);
      torch::stable::copy_(words, clear_words_for(words));
      const int64_t* word = host.mutable_data_ptr<int64_t>();
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
