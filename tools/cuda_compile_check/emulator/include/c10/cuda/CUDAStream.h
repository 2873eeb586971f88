// Emulator stand-in: kernels run synchronously; the stream is a null handle.
#pragma once
#include <cuda_runtime.h>
namespace c10 {
namespace cuda {
struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(int = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
