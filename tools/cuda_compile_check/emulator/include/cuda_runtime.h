// Emulator stand-in for the CUDA runtime API (see ../cuda_emulator.h): the few calls crfkit's
// host code makes, answered for a pretend device whose size comes from environment variables.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>

struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaError_t { cudaSuccess = 0 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxThreadsPerMultiProcessor = 39 };

namespace emu {
inline int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::atoi(value) : fallback;
}
}  // namespace emu

inline cudaError_t cudaGetDevice(int* device) { *device = 0; return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
// Nothing is ever captured.
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline const char* cudaGetErrorString(cudaError_t) { return "no error"; }
// Kernels run to completion at their launch here, so an asynchronous memset is a plain one.
inline cudaError_t cudaMemsetAsync(void* to, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(to, value, bytes);
  return cudaSuccess;
}
// CRFKIT_EMU_SMS multiprocessors (default 2) of 2048 threads ...
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  *value = attribute == cudaDevAttrMaxThreadsPerMultiProcessor ? 2048 : emu::env_int("CRFKIT_EMU_SMS", 2);
  return cudaSuccess;
}
// ... each holding CRFKIT_EMU_BLOCKS_PER_SM blocks (default 1): a small persistent grid, so
// that every group walks several sentences.
template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = emu::env_int("CRFKIT_EMU_BLOCKS_PER_SM", 1);
  return cudaSuccess;
}
