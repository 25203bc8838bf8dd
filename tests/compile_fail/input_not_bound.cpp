// Evaluating without binding every input.
// expect: an input of the plan is not bound
// expect: input_binding<lina::fixed_string<2>\{"V"\}, 0>
// errors: 1
#include "_prelude.hpp"
int main() {
  tensor<float> q({1, 1, 4, 32}), v({1, 1, 4, 16});
#ifdef LINA_COMPILE_FAIL
  auto out = cpu::evaluate(compile(attn), Q = q, K = q);
#else
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, V = v);
#endif
  (void)out;
}
