# CUDA compilation settings: the architectures, static runtime, C++20.
find_package(CUDAToolkit REQUIRED)
# CMake 3.25 predates nvcc's C++20 support: teach it the flag.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
# Architectures: the portable kernels (cache ops, merge, decode, the mma.sync prefill, amax,
# quantisation, MLA's combine and projections) as machine code for each listed architecture and
# as PTX of the lowest (which later GPUs, Blackwell included, compile when they load it); the
# Hopper kernels (the wgmma prefill and MLA decode) as sm_90a code when 90a is listed. A shorter
# list builds faster (-DPAGEDATTN_CUDA_ARCHS=90a: Hopper only; 80: one portable build).
set(PAGEDATTN_CUDA_ARCHS "80;86;89;90a"
    CACHE STRING "CUDA architectures to compile (from 80, 86, 89, 90a)")
set(PAGEDATTN_CUDA_GENCODE_PORTABLE "")
set(PAGEDATTN_CUDA_HOPPER OFF)
set(_pagedattn_lowest "")
foreach(arch ${PAGEDATTN_CUDA_ARCHS})
  if(NOT arch MATCHES "^(80|86|89|90a)$")
    message(FATAL_ERROR "PAGEDATTN_CUDA_ARCHS: ${arch} is not one of 80, 86, 89, 90a")
  endif()
  list(APPEND PAGEDATTN_CUDA_GENCODE_PORTABLE "-gencode=arch=compute_${arch},code=sm_${arch}")
  if(arch STREQUAL "90a")
    set(PAGEDATTN_CUDA_HOPPER ON)
  elseif(NOT _pagedattn_lowest)
    set(_pagedattn_lowest ${arch})
  endif()
endforeach()
if(_pagedattn_lowest)
  list(APPEND PAGEDATTN_CUDA_GENCODE_PORTABLE
       "-gencode=arch=compute_${_pagedattn_lowest},code=compute_${_pagedattn_lowest}")
endif()
set(PAGEDATTN_CUDA_GENCODE_HOPPER "-gencode=arch=compute_90a,code=sm_90a")
message(STATUS "pagedattn: CUDA architectures ${PAGEDATTN_CUDA_ARCHS}")
add_library(pagedattn_cuda_flags INTERFACE)
target_compile_options(pagedattn_cuda_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
