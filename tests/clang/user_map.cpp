// A user-defined element-wise map whose formula calls the C library (tanh),
// evaluated and differentiated, as a user writes it: lina's headers must
// compile without warnings under Clang with optimisation (ctest
// clang.optimised_user_map: -O2 -Werror). Clang's vectoriser cannot vectorise
// such a loop, and a loop lina asked it to vectorise (#pragma omp simd) then
// warns (-Wpass-failed).
#include <lina/cpu.hpp>
#include <lina/lina.hpp>

#include <cmath>
#include <string_view>

struct soft_sign {
  static constexpr std::string_view name = "tanh+1";
  template <class T>
  static T value(T x) { return std::tanh(x) + T(1); }
  template <class T>
  static T derivative(T x) { T const t = std::tanh(x); return T(1) - t * t; }
};

int main() {
  using namespace lina;
  constexpr auto N = dim<"N">;
  constexpr auto D = dim<"D">;
  constexpr auto M = dim<"M">;
  constexpr auto Q = input<"Q">(N, D);
  constexpr auto K = input<"K">(N, D);
  constexpr auto V = input<"V">(N, M);
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<soft_sign>(Q) * transpose(phi<soft_sign>(K)))) * V);
  auto q = tensor<float>::random({1, 2, 50, 8}, 1), k = tensor<float>::random({1, 2, 50, 8}, 2);
  auto v = tensor<float>::random({1, 2, 50, 4}, 3);
  auto out = cpu::evaluate(plan, Q = q, K = k, V = v);
  auto g = cpu::gradient(plan, out, Q = q, K = k, V = v);
  return out.size() > 0 && g[Q].size() > 0 ? 0 : 1;
}
