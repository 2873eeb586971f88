// Emulator stand-in: nothing is ever captured.
#pragma once
namespace c10 {
namespace cuda {
enum class CaptureStatus : int { None = 0, Active = 1, Invalidated = 2 };
inline CaptureStatus currentStreamCaptureStatusMayInitCtx() { return CaptureStatus::None; }
}  // namespace cuda
}  // namespace c10
