# Install the built tree into a scratch prefix, then configure, build and run
# tests/consumer against it with find_package(lina) (with the CUDA backend:
# its kernel embedded by lina_cuda_embed_kernels).
#
# With -DCPU_ONLY=ON it first configures lina itself as on a machine without the
# CUDA Toolkit (CMake told the package is absent), installs that, and checks that
# the consumer builds and runs with the CPU backend alone.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
if(NOT CPU_ONLY)
  set(ENV{LINA_CUDA_CACHE} ${BUILD_DIR}/tests/nvrtc-cache)  # (the CUDA consumer's generator: not the user's cache)
else()
  set(BUILD_DIR ${WORK_DIR}/lina)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -DCMAKE_CXX_COMPILER=${CXX}
                          -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DLINA_BUILD_EXAMPLES=OFF -DLINA_BUILD_TESTS=OFF
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "the CUDA backend is left out")
    message(FATAL_ERROR "configuring lina without the CUDA Toolkit failed:\n${out}\n${err}")
  endif()
endif()
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/tests/consumer;-B;${WORK_DIR}/build;-DCMAKE_PREFIX_PATH=${prefix};-DCMAKE_CXX_COMPILER=${CXX};-DCMAKE_BUILD_TYPE=Release"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/build"
    "${WORK_DIR}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed: ${step}\n${out}\n${err}")
  endif()
endforeach()
message("${out}")
if(CPU_ONLY AND EXISTS ${WORK_DIR}/build/consumer_cuda)
  message(FATAL_ERROR "a lina configured without the CUDA Toolkit exported lina::cuda")
endif()
if(EXISTS ${WORK_DIR}/build/consumer_cuda)
  execute_process(COMMAND ${WORK_DIR}/build/consumer_cuda RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer_cuda failed:\n${out}\n${err}")
  endif()
  message("${out}")
endif()
