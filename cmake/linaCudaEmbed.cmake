# lina_cuda_embed_kernels(<target> GENERATOR <source.cpp> [ARCHS sm_90 …])
#
# Compiles the CUDA kernels a program launches ahead of time and links them
# into <target>, so that its launches find them without running NVRTC (no
# compile on a first launch; docs/cuda.md). <source.cpp> is a small program
# of yours whose main returns
#     lina::cuda::embed_main(argc, argv, kernels)
# for the kernels your target launches (lina::cuda::kernels_of(plan, opts,
# D = …, M = …) for each plan, joined). It is built for the build machine and
# run at build time (NVRTC, no GPU) for each architecture in ARCHS (default
# sm_90); what it writes is compiled into <target>. A kernel that is not
# embedded (another D, another architecture) is compiled at run time as before.
function(lina_cuda_embed_kernels target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "GENERATOR" "ARCHS")
  if(NOT arg_GENERATOR)
    message(FATAL_ERROR "lina_cuda_embed_kernels(${target}): GENERATOR <source.cpp> is required")
  endif()
  if(NOT arg_ARCHS)
    set(arg_ARCHS sm_90)
  endif()
  set(generator ${target}_lina_kernels)
  add_executable(${generator} ${arg_GENERATOR})
  target_link_libraries(${generator} PRIVATE lina::cuda)
  set(out ${CMAKE_CURRENT_BINARY_DIR}/${target}_lina_kernels.cpp)
  set(arch_args)
  foreach(arch ${arg_ARCHS})
    list(APPEND arch_args --arch ${arch})
  endforeach()
  add_custom_command(OUTPUT ${out}
                     COMMAND ${generator} --out ${out} ${arch_args}
                     DEPENDS ${generator}
                     COMMENT "lina: compiling the kernels of ${target} ahead of time (${arg_ARCHS})"
                     VERBATIM)
  target_sources(${target} PRIVATE ${out})
  target_link_libraries(${target} PRIVATE lina::cuda)
endfunction()
