// Stand-in for the header CMake generates in torch's CUDA builds (absent from CPU wheels); on the include path of tools/cuda_compile_check only.
#define C10_CUDA_BUILD_SHARED_LIBS
