// Binding a symbol the plan does not use.
// expect: a bound symbol is not an input of the plan
// expect: binding_symbol<lina::fixed_string<2>\{"W"\}, false>
// errors: 1
#include "_prelude.hpp"
int main() {
  constexpr auto W = input<"W">(N, M);
  tensor<float> q({1, 1, 4, 32}), v({1, 1, 4, 16});
#ifdef LINA_COMPILE_FAIL
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, V = v, W = v);
#else
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, V = v);
#endif
  (void)out;
  (void)W;
}
