// Emulator stand-in: errors of the pretend runtime never happen.
#pragma once
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#define C10_CUDA_CHECK(expr) TORCH_CHECK((expr) == cudaSuccess, "emulated CUDA call failed: " #expr)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
