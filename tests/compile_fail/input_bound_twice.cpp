// Binding one input twice.
// expect: an input is bound twice
// expect: input_binding<lina::fixed_string<2>\{"K"\}, 2>
// errors: 1
#include "_prelude.hpp"
int main() {
  tensor<float> q({1, 1, 4, 32}), v({1, 1, 4, 16});
#ifdef LINA_COMPILE_FAIL
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, K = q, V = v);
#else
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, V = v);
#endif
  (void)out;
}
