// The attention the CUDA consumer launches, shared by it and its generator.
#pragma once
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

namespace consumer {
using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
inline cuda::program kernel() { return cuda::program_of(plan, {}); }
}  // namespace consumer
