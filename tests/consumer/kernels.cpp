// The generator lina_cuda_embed_kernels builds and runs: the consumer's kernel.
#include <lina/cuda/embed.hpp>

#include "plan.hpp"

int main(int argc, char** argv) { return lina::cuda::embed_main(argc, argv, {consumer::kernel()}); }
