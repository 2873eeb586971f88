// crfkit's view of torch's stable C ABI (torch/csrc/stable, torch/headeronly): the tensor type,
// allocation, dtype dispatch and argument checks every kernel file uses, written once.
//
// Why the stable ABI: a library built against it calls torch only through versioned C functions
// (the aoti_torch_* / torch_* shim), so one binary loads under every torch from the version it
// targets on (TORCH_TARGET_VERSION, set by crfkit/_build_config.py), where a build against
// ATen's C++ API loads under the exact torch it was built with only.
//
// Errors: a kernel throws standard exceptions, which torch's Python binding turns into Python
// ones: CRFKIT_CHECK_VALUE and CRFKIT_CHECK_TYPE throw std::invalid_argument (ValueError: the
// stable ABI has no way to raise TypeError, so a wrong dtype given straight to torch.ops.crfkit
// is a ValueError; crfkit.functional checks dtypes first and raises TypeError), CRFKIT_CHECK
// throws std::runtime_error (RuntimeError).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace crfkit {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Device = torch::stable::Device;
using Sizes = torch::headeronly::IntHeaderOnlyArrayRef;  // a borrowed list of int64 (sizes)

inline constexpr ScalarType kFloat = ScalarType::Float;
inline constexpr ScalarType kDouble = ScalarType::Double;
inline constexpr ScalarType kLong = ScalarType::Long;
inline constexpr ScalarType kInt = ScalarType::Int;
inline constexpr ScalarType kByte = ScalarType::Byte;

// ---- messages and checks ------------------------------------------------------------------------
namespace detail {
inline std::ostream& print(std::ostream& out, Sizes sizes) {
  out << "[";
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  return out << "]";
}
inline std::ostream& print(std::ostream& out, const Device& device) {
  out << (device.is_cuda() ? "cuda" : device.is_cpu() ? "cpu" : "device");
  if (device.has_index()) out << ":" << static_cast<int>(device.index());
  return out;
}
template <typename T>
std::ostream& print(std::ostream& out, const T& value) {
  return out << value;
}
template <typename... Args>
std::string message(const Args&... args) {
  std::ostringstream out;
  (print(out, args), ...);
  return out.str();
}
}  // namespace detail

}  // namespace crfkit

// The message is the arguments printed one after the other (sizes as [2, 3], devices as cuda:0).
#define CRFKIT_CHECK_AS(exception, cond, ...)                          \
  do {                                                                 \
    if (!(cond)) [[unlikely]] {                                        \
      throw exception(::crfkit::detail::message(__VA_ARGS__));         \
    }                                                                  \
  } while (false)
#define CRFKIT_CHECK(cond, ...) CRFKIT_CHECK_AS(std::runtime_error, cond, __VA_ARGS__)
#define CRFKIT_CHECK_VALUE(cond, ...) CRFKIT_CHECK_AS(std::invalid_argument, cond, __VA_ARGS__)
#define CRFKIT_CHECK_TYPE(cond, ...) CRFKIT_CHECK_AS(std::invalid_argument, cond, __VA_ARGS__)

// CRFKIT_DISPATCH_FLOATING_TYPES(dtype, name, [&] { ... scalar_t ... }): the lambda run with
// scalar_t = float or double, as ATen's AT_DISPATCH_FLOATING_TYPES.
#define CRFKIT_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...)                                      \
  [&] {                                                                                     \
    switch (TYPE) {                                                                         \
      case ::crfkit::kFloat: {                                                              \
        using scalar_t = float;                                                             \
        return __VA_ARGS__();                                                               \
      }                                                                                     \
      case ::crfkit::kDouble: {                                                             \
        using scalar_t = double;                                                            \
        return __VA_ARGS__();                                                               \
      }                                                                                     \
      default:                                                                              \
        throw std::invalid_argument(::crfkit::detail::message(NAME, ": expected float32 or float64, got ", TYPE)); \
    }                                                                                       \
  }()

namespace crfkit {

// Bytes per element of the dtypes the kernels allocate.
inline int64_t element_bytes(ScalarType dtype) {
  switch (dtype) {
    case kDouble:
    case kLong:
      return 8;
    case kFloat:
    case kInt:
      return 4;
    case kByte:
      return 1;
    default:
      throw std::invalid_argument(detail::message("crfkit: no element size for dtype ", dtype));
  }
}

// ---- allocation ---------------------------------------------------------------------------------
// What ATen's TensorOptions held for these kernels: a dtype and a device.
struct TensorOptions {
  ScalarType dtype_;
  Device device_;
  TensorOptions dtype(ScalarType dtype) const { return {dtype, device_}; }
};

inline TensorOptions options_of(const Tensor& t) { return {t.scalar_type(), t.device()}; }

// A new contiguous tensor, its memory uninitialised. Through the C shim's
// aoti_torch_empty_strided, not torch::stable::empty: that one finds aten::empty in the
// dispatcher by name on every call, about 6 us more per allocation (measured on torch 2.13,
// benchmarks/results/stable_abi_ab.md), which small calls pay several times.
inline Tensor empty(Sizes sizes, const TensorOptions& options) {
  int64_t strides[8];
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  CRFKIT_CHECK(ndim <= 8, "crfkit: at most 8 dimensions, got ", ndim);
  for (int64_t d = ndim - 1, stride = 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  using torch::stable::detail::from;
  using torch::stable::detail::to;
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      ndim, sizes.data(), strides, to<int32_t>(from(options.dtype_)), to<int32_t>(from(options.device_.type())),
      options.device_.has_index() ? options.device_.index() : 0, &handle));
  return Tensor(handle);
}
// fill_ is a direct shim call (aoti_torch_aten_fill__Scalar); zero_ and full go through the
// dispatcher by name.
inline Tensor full(Sizes sizes, double value, const TensorOptions& options) {
  Tensor t = empty(sizes, options);
  torch::stable::fill_(t, value);
  return t;
}
inline Tensor zeros(Sizes sizes, const TensorOptions& options) { return full(sizes, 0.0, options); }
inline Tensor zeros_like(const Tensor& t) { return zeros(t.sizes(), options_of(t)); }
// A contiguous tensor of t's sizes, dtype and device (torch::stable::empty_like goes through the
// dispatcher by name).
inline Tensor empty_as(const Tensor& t) { return empty(t.sizes(), options_of(t)); }

inline Tensor as_contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}
inline Tensor to_dtype(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}
// The sum over the first dimension, in t's dtype.
inline Tensor sum_first_dim(const Tensor& t) {
  const std::vector<int64_t> dims = {0};
  return torch::stable::sum(t, Sizes(dims));
}

// t filled with zeros, returned (ATen's t.zero_() on a temporary).
inline Tensor zeroed(Tensor t) {
  torch::stable::fill_(t, 0.0);
  return t;
}

// ---- CPU threads --------------------------------------------------------------------------------
// The flag telling code inside one of crfkit's parallel tasks that it runs in one (ATen's
// at::in_parallel_region() has no stable counterpart): set by crfkit::cpu::parallel_for
// (csrc/cpu/isa.h), one per thread for the whole library. It sees crfkit's own tasks, not a
// parallel region of the caller's.
namespace detail {
inline thread_local bool in_parallel_task = false;
}  // namespace detail

inline bool in_parallel_region() { return detail::in_parallel_task; }

inline int64_t num_threads() { return static_cast<int64_t>(torch::stable::get_num_threads()); }

// Typed element pointers (ATen's data_ptr<T>()).
template <typename T>
T* data(const Tensor& t) {
  return t.mutable_data_ptr<T>();
}

}  // namespace crfkit
