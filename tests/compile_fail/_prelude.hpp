// Shared declarations of the compile-fail cases (each case is compiled once
// without LINA_COMPILE_FAIL, where it must compile, and once with it).
#pragma once
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 32>;
constexpr auto M = dim<"M", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
