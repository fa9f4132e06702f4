# NCCL for pagedattn_nccl (the GPU exchanges of tensor and decode context parallelism). Looked
# for in NCCL_ROOT (a CMake variable or the environment: a directory with include/nccl.h and
# lib/libnccl.so.2, e.g. the nvidia-nccl-cu13 wheel's nvidia/nccl that scripts/test.sh
# installs), else in the NCCL wheel of the python3 on PATH (PyTorch brings one), else in the
# system. Sets PAGEDATTN_WITH_NCCL. NCCL ships no static library here: binaries that link it
# load libnccl.so.2 at run time (LD_LIBRARY_PATH, or the build tree's RPATH).
set(PAGEDATTN_WITH_NCCL OFF)
set(_pagedattn_nccl_hints)
if(NCCL_ROOT)
  list(APPEND _pagedattn_nccl_hints ${NCCL_ROOT})
elseif(DEFINED ENV{NCCL_ROOT})
  list(APPEND _pagedattn_nccl_hints $ENV{NCCL_ROOT})
else()
  find_program(PAGEDATTN_NCCL_PYTHON NAMES python3)
  if(PAGEDATTN_NCCL_PYTHON)
    # nvidia.nccl is a namespace package (no __file__): its first path is the wheel's folder.
    execute_process(
      COMMAND ${PAGEDATTN_NCCL_PYTHON} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
      OUTPUT_VARIABLE _pagedattn_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _pagedattn_nccl_rc ERROR_QUIET)
    if(_pagedattn_nccl_rc EQUAL 0 AND _pagedattn_nccl_wheel)
      list(APPEND _pagedattn_nccl_hints ${_pagedattn_nccl_wheel})
    endif()
  endif()
endif()
# Look again when the hints changed (another NCCL_ROOT, a new wheel) since the last configure.
if(NOT "${_pagedattn_nccl_hints}" STREQUAL "${PAGEDATTN_NCCL_HINTS_USED}")
  unset(PAGEDATTN_NCCL_INCLUDE_DIR CACHE)
  unset(PAGEDATTN_NCCL_LIBRARY CACHE)
  set(PAGEDATTN_NCCL_HINTS_USED "${_pagedattn_nccl_hints}" CACHE INTERNAL "")
endif()
# A given NCCL_ROOT is the only place looked in (header and library from one installation);
# NAMES_PER_DIR: the wheel has only libnccl.so.2, which must win over a libnccl.so elsewhere.
set(_pagedattn_nccl_only)
if(NCCL_ROOT OR DEFINED ENV{NCCL_ROOT})
  set(_pagedattn_nccl_only NO_DEFAULT_PATH)
endif()
find_path(PAGEDATTN_NCCL_INCLUDE_DIR nccl.h HINTS ${_pagedattn_nccl_hints}
          PATH_SUFFIXES include ${_pagedattn_nccl_only})
find_library(PAGEDATTN_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
             HINTS ${_pagedattn_nccl_hints} PATH_SUFFIXES lib lib64 ${_pagedattn_nccl_only})
if(PAGEDATTN_NCCL_INCLUDE_DIR AND PAGEDATTN_NCCL_LIBRARY)
  file(STRINGS ${PAGEDATTN_NCCL_INCLUDE_DIR}/nccl.h _pagedattn_nccl_version
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE "[^0-9;]" "" _pagedattn_nccl_version "${_pagedattn_nccl_version}")
  string(REPLACE ";" "." _pagedattn_nccl_version "${_pagedattn_nccl_version}")
  message(STATUS "pagedattn: NCCL ${_pagedattn_nccl_version}: ${PAGEDATTN_NCCL_LIBRARY}")
  set(PAGEDATTN_WITH_NCCL ON)
else()
  message(STATUS "pagedattn: no NCCL (set NCCL_ROOT, e.g. to the nvidia-nccl-cu13 wheel's "
                 "nvidia/nccl): pagedattn_nccl and its tests are off")
endif()
