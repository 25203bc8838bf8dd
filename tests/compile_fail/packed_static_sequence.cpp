// Packed sequences differ in length, so their dimension is known at run time.
// expect: packed sequences need a run-time sequence dimension
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto L = dim<"L", 8>;
#else
  constexpr auto L = dim<"L">;
#endif
  constexpr auto Qs = input<"Q">(L, D);
  constexpr auto Ks = input<"K">(L, D);
  constexpr auto Vs = input<"V">(L, M);
  constexpr auto a = normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs;
  auto q = tensor<float>::random({1, 1, 8, 32}, 1), k = tensor<float>::random({1, 1, 8, 32}, 2);
  auto v = tensor<float>::random({1, 1, 8, 16}, 3);
  auto y = cpu::evaluate(compile(a), sequences::from_lengths({3, 5}), Qs = q, Ks = k, Vs = v);
  (void)y;
}
