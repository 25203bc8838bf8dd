# Install the built tree into a scratch prefix, then configure, build and run
# tests/consumer against it with find_package(lina) (with the CUDA backend:
# its kernel embedded by lina_cuda_embed_kernels).
file(REMOVE_RECURSE ${WORK_DIR})
set(ENV{LINA_CUDA_CACHE} ${BUILD_DIR}/tests/nvrtc-cache)  # (the CUDA consumer's generator: not the user's cache)
set(prefix ${WORK_DIR}/prefix)
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
if(EXISTS ${WORK_DIR}/build/consumer_cuda)
  execute_process(COMMAND ${WORK_DIR}/build/consumer_cuda RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer_cuda failed:\n${out}\n${err}")
  endif()
  message("${out}")
endif()
