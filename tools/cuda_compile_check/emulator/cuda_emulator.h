// A CPU emulator for crfkit's CUDA kernels: force-included (g++ -include) before a copy of
// csrc/cuda/*.cu in which build.py rewrote only the two things C++ cannot parse, the launch
// syntax `kernel<<<grid, block, shared, stream>>>(args)` -> `::emu::launch(kernel, grid, block,
// shared, stream)(args)` and the dynamic shared memory declaration. Everything else is the
// kernels' own source.
//
// Execution model: the blocks of a launch run one after the other; the threads of a block are
// real std::threads, the same ones for every block of the launch (so lanes genuinely
// interleave, and ThreadSanitizer can see accesses that no barrier orders). __syncthreads is a
// barrier of the block, __syncwarp one of the warp, a shuffle is a write to the warp's exchange
// slots between two warp barriers. Like the hardware, a warp barrier or a shuffle needs ALL 32
// lanes: a divergent call deadlocks here (the tests run with a timeout). Dynamic shared memory
// is an exact-size heap block per block (AddressSanitizer sees overflows), limited to 48 KiB as
// without an opt-in on a real device. Atomics take one global mutex. The pretend device has
// CRFKIT_EMU_SMS multiprocessors of CRFKIT_EMU_BLOCKS_PER_SM blocks (include/cuda_runtime.h).
#pragma once

#include <ATen/ATen.h>  // TORCH_CHECK, and for race_check.cpp, which calls the ops through ATen
#include <math.h>
// The stable-ABI headers the kernels' host code uses (csrc/tensor.h, csrc/cuda/common.cuh), read
// here first so that the renames at the end of this file do not reach them.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

constexpr int kWarp = 32;
constexpr size_t kMaxSharedBytes = 48 * 1024;

struct Block {
  explicit Block(unsigned threads, size_t shared_bytes)
      : barrier(threads), shared(new unsigned char[shared_bytes > 0 ? shared_bytes : 1]) {
    for (unsigned w = 0; w < threads / kWarp; ++w) warp_barriers.emplace_back(std::make_unique<std::barrier<>>(kWarp));
    slots.resize(threads / kWarp);
    votes.resize(threads);
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<std::array<uint64_t, kWarp>> slots;  // shuffle exchange, one row per warp
  std::vector<int> votes;                          // __syncthreads_or, one per thread
  std::unique_ptr<unsigned char[]> shared;
};

inline thread_local Block* block = nullptr;

inline unsigned char* dynamic_shared() { return block->shared.get(); }

inline std::mutex& atomic_mutex() {
  static std::mutex m;
  return m;
}

template <typename G>
dim3 to_dim3(G g) {
  if constexpr (std::is_same_v<G, dim3>) {
    return g;
  } else {
    TORCH_CHECK(g >= 1 && (int64_t)g <= (int64_t{1} << 31) - 1, "emulator: bad launch dimension ", (int64_t)g);
    return dim3(static_cast<unsigned>(g));
  }
}

template <typename... Params>
struct Launch {
  void (*kernel)(Params...);
  dim3 grid, threads;
  size_t shared_bytes;

  template <typename... Args>
  void operator()(Args&&... args) const {
    TORCH_CHECK(grid.y == 1 && grid.z == 1 && threads.y == 1 && threads.z == 1, "emulator: 1-d launches only");
    TORCH_CHECK(threads.x >= 1 && threads.x <= 1024 && threads.x % kWarp == 0,
                "emulator: blocks of whole warps, at most 1024 threads, got ", threads.x);
    TORCH_CHECK(shared_bytes <= kMaxSharedBytes, "emulator: ", shared_bytes,
                " bytes of dynamic shared memory need an opt-in on a real device");
    const std::tuple<Params...> params(std::forward<Args>(args)...);
    // One OS thread per lane for the whole launch (not per block: a grid-stride kernel of
    // 4096 blocks would otherwise create a million threads). Between blocks every lane waits
    // at `between`, whose completion step gives the next block a fresh state.
    std::unique_ptr<Block> state;
    auto start_next_block = [&]() noexcept {
      state = std::make_unique<Block>(threads.x, shared_bytes);
      // Garbage, not zeros: a kernel must not rely on fresh shared memory.
      std::memset(state->shared.get(), 0xA5, shared_bytes);
    };
    std::barrier between(static_cast<std::ptrdiff_t>(threads.x), start_next_block);
    std::vector<std::thread> lanes;
    lanes.reserve(threads.x);
    for (unsigned tx = 0; tx < threads.x; ++tx) {
      lanes.emplace_back([&, tx] {
        threadIdx = dim3(tx);
        blockDim = threads;
        gridDim = grid;
        for (unsigned bx = 0; bx < grid.x; ++bx) {
          between.arrive_and_wait();  // block bx - 1 finished in every lane; bx's state is ready
          blockIdx = dim3(bx);
          block = state.get();
          std::apply(kernel, params);
        }
      });
    }
    for (auto& lane : lanes) lane.join();
  }
};

template <typename... Params, typename G, typename B>
Launch<Params...> launch(void (*kernel)(Params...), G grid, B threads, size_t shared_bytes = 0, cudaStream_t = nullptr) {
  return Launch<Params...>{kernel, to_dim3(grid), to_dim3(threads), shared_bytes};
}

}  // namespace emu

inline void __syncthreads() { emu::block->barrier.arrive_and_wait(); }

// A block barrier that returns, in every thread, whether the predicate held in any thread.
inline int __syncthreads_or(int predicate) {
  auto& votes = emu::block->votes;
  votes[threadIdx.x] = predicate != 0;
  __syncthreads();
  int any = 0;
  for (const int vote : votes) any |= vote;
  __syncthreads();  // every thread has read the votes before they are written again
  return any;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  TORCH_CHECK(mask == 0xffffffffu, "emulator: only full-warp __syncwarp");
  emu::block->warp_barriers[threadIdx.x / emu::kWarp]->arrive_and_wait();
}

namespace emu {
// The shuffles the emulator supports: the full warp, groups of a power-of-two `width` lanes,
// a lane argument (`what`: the xor mask or the source lane) inside the group.
template <typename V>
void check_shuffle(unsigned mask, int lane_argument, int width, const char* what) {
  static_assert(sizeof(V) <= sizeof(uint64_t), "emulator: shuffles of at most 8 bytes");
  TORCH_CHECK(mask == 0xffffffffu && width >= 1 && width <= kWarp && (width & (width - 1)) == 0 &&
                  lane_argument >= 0 && lane_argument < width,
              "emulator: unsupported shuffle (mask ", mask, ", ", what, " ", lane_argument, ", width ", width, ")");
}

// One shuffle: every lane of the warp posts `value`, then reads the value lane `source` posted.
template <typename V>
V exchange(V value, unsigned source) {
  const unsigned lane = threadIdx.x % kWarp;
  auto& slots = block->slots[threadIdx.x / kWarp];
  std::memcpy(&slots[lane], &value, sizeof(V));
  __syncwarp();
  V other;
  std::memcpy(&other, &slots[source], sizeof(V));
  __syncwarp();
  return other;
}
}  // namespace emu

template <typename V>
V __shfl_xor_sync(unsigned mask, V value, int lane_mask, int width = emu::kWarp) {
  emu::check_shuffle<V>(mask, lane_mask, width, "lane mask");
  const unsigned lane = threadIdx.x % emu::kWarp;
  return emu::exchange(value, lane ^ static_cast<unsigned>(lane_mask));
}

// Broadcast within groups of `width` lanes: every lane gets the value of lane src_lane of its group.
template <typename V>
V __shfl_sync(unsigned mask, V value, int src_lane, int width = emu::kWarp) {
  emu::check_shuffle<V>(mask, src_lane, width, "source lane");
  const unsigned lane = threadIdx.x % emu::kWarp;
  return emu::exchange(value, lane / width * width + src_lane);
}

// True in every lane when the predicate holds in any lane of the warp.
inline bool __any_sync(unsigned mask, bool predicate) {
  TORCH_CHECK(mask == 0xffffffffu, "emulator: only full-warp votes");
  const unsigned lane = threadIdx.x % emu::kWarp;
  auto& slots = emu::block->slots[threadIdx.x / emu::kWarp];
  slots[lane] = predicate ? 1 : 0;
  __syncwarp();
  bool any = false;
  for (int other = 0; other < emu::kWarp; ++other) any = any || slots[other] != 0;
  __syncwarp();
  return any;
}

inline long long atomicMin(long long* address, long long value) {
  std::lock_guard<std::mutex> lock(emu::atomic_mutex());
  const long long old = *address;
  if (value < old) *address = value;
  return old;
}

template <typename V>
V atomicAdd(V* address, V value) {
  std::lock_guard<std::mutex> lock(emu::atomic_mutex());
  const V old = *address;
  *address = old + value;
  return old;
}

// The pretend device's torch side: its current stream is a null handle (the kernels run at their
// launch), and there is no device to switch to (torch's DeviceGuard would fail on a CPU-only
// torch, which has no accelerator). A CPU-only torch's shim.h does not declare the stream call
// (csrc/cuda/common.cuh does, as for a real build, and finds this definition).
extern "C" AOTI_TORCH_EXPORT inline AOTITorchError aoti_torch_get_current_cuda_stream(int32_t, void** ret_stream) {
  *ret_stream = nullptr;
  return AOTI_TORCH_SUCCESS;
}
namespace emu {
struct DeviceGuard {
  explicit DeviceGuard(int32_t) {}
};
}  // namespace emu
HIDDEN_NAMESPACE_BEGIN(torch, stable, accelerator)
using EmulatedDeviceGuard = ::emu::DeviceGuard;
HIDDEN_NAMESPACE_END(torch, stable, accelerator)
#define DeviceGuard EmulatedDeviceGuard

// The emulated ops are registered as crfkit_emu::* for CPU tensors (the schemas are generated
// from csrc/crfkit.cpp by build.py), and "CUDA tensors" are the CPU tensors they get.
#undef STABLE_TORCH_LIBRARY_IMPL
#define STABLE_TORCH_LIBRARY_IMPL(ns, k, m) _STABLE_TORCH_LIBRARY_IMPL(crfkit_emu, CPU, m, C10_UID)
#define is_cuda is_cpu
