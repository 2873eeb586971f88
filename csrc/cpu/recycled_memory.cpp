// The recycled buffers of recycled_memory.h.

#include "../tensor.h"
#include "recycled_memory.h"

#include <cstdlib>

#include <mutex>
#include <vector>

namespace crfkit {
namespace cpu {
namespace {

// 64-byte aligned (whole cache lines, aligned vector loads); capacity is a multiple of kRounding.
void* checked_aligned_alloc(int64_t capacity) {
  void* data = std::aligned_alloc(64, static_cast<size_t>(capacity));
  CRFKIT_CHECK(data != nullptr, "crfkit: out of memory allocating ", capacity, " bytes");
  return data;
}

constexpr int64_t kRounding = int64_t{1} << 16;  // 64 KiB

struct KeptBuffer {
  void* data;
  int64_t bytes;
};

class BufferCache {
 public:
  // Never destroyed: a tensor that outlives static destruction (freed at interpreter exit) still
  // hands its buffer back here.
  static BufferCache& instance() {
    static BufferCache* cache = new BufferCache;
    return *cache;
  }

  // A buffer of at least `bytes` bytes (64-byte aligned) and its capacity.
  KeptBuffer take(int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      int64_t best = -1;
      for (int64_t k = 0; k < static_cast<int64_t>(kept_.size()); ++k) {
        const int64_t capacity = kept_[k].bytes;
        if (capacity >= bytes && capacity <= 2 * bytes + kRounding && (best < 0 || capacity < kept_[best].bytes)) best = k;
      }
      if (best >= 0) {
        const KeptBuffer found = kept_[best];
        kept_.erase(kept_.begin() + best);
        kept_bytes_ -= found.bytes;
        return found;
      }
    }
    // Rounded up so that tensors of nearby sizes (another batch's longest sentence) fit each
    // other's buffers.
    const int64_t capacity = (bytes + kRounding - 1) / kRounding * kRounding;
    return {checked_aligned_alloc(capacity), capacity};
  }

  void give_back(KeptBuffer buffer) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_bytes_ + buffer.bytes <= kMaxCachedBytes &&
          static_cast<int64_t>(kept_.size()) < kMaxCachedBuffers) {
        kept_.push_back(buffer);
        kept_bytes_ += buffer.bytes;
        return;
      }
    }
    std::free(buffer.data);
  }

  int64_t release() {
    std::vector<KeptBuffer> freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      freed.swap(kept_);
      kept_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const KeptBuffer& buffer : freed) {
      bytes += buffer.bytes;
      std::free(buffer.data);
    }
    return bytes;
  }

  int64_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_bytes_;
  }

 private:
  std::mutex mutex_;
  std::vector<KeptBuffer> kept_;
  int64_t kept_bytes_ = 0;
};

}  // namespace

Tensor recycled_tensor(Sizes sizes, ScalarType dtype) {
  const TensorOptions options{dtype, Device(torch::headeronly::DeviceType::CPU)};
#if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_11_0
  int64_t elements = 1;
  for (const int64_t size : sizes) elements *= size;
  const int64_t bytes = elements * element_bytes(dtype);
  if (bytes < kRounding) return empty(sizes, options);
  const KeptBuffer buffer = BufferCache::instance().take(bytes);
  const int64_t capacity = buffer.bytes;
  std::vector<int64_t> strides(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1, stride = 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  return torch::stable::from_blob(
      buffer.data, sizes, Sizes(strides), options.device_, dtype,
      [capacity](void* data) { BufferCache::instance().give_back({data, capacity}); });
#else
  // torch 2.10's stable ABI has no from_blob with a deleter (2.11 has): a plain allocation, so
  // a binary built for 2.10 keeps no buffers (recycled_memory.h says what that costs).
  return empty(sizes, options);
#endif
}

int64_t release_recycled_memory() { return BufferCache::instance().release(); }

int64_t recycled_memory_bytes() { return BufferCache::instance().kept_bytes(); }

}  // namespace cpu
}  // namespace crfkit
