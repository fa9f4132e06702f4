# CUDA compilation settings: Hopper (sm_90a) machine code, static runtime, C++20.
find_package(CUDAToolkit REQUIRED)
# CMake 3.25 predates nvcc's C++20 support: teach it the flag.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(PAGEDATTN_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a"
    CACHE STRING "nvcc -gencode flags for the CUDA kernels")
separate_arguments(_pagedattn_gencode UNIX_COMMAND "${PAGEDATTN_CUDA_GENCODE}")
add_library(pagedattn_cuda_flags INTERFACE)
target_compile_options(pagedattn_cuda_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:${_pagedattn_gencode} --expt-relaxed-constexpr -lineinfo>)
target_link_options(pagedattn_cuda_flags INTERFACE
  $<$<LINK_LANGUAGE:CUDA>:${_pagedattn_gencode}>)
