// float and double bound in one evaluation.
// expect: all bound tensors must have the same element type
// errors: 1
#include "_prelude.hpp"
int main() {
  tensor<float> q({1, 1, 4, 32}), v({1, 1, 4, 16});
  tensor<double> vd({1, 1, 4, 16});
#ifdef LINA_COMPILE_FAIL
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, V = vd);
#else
  auto out = cpu::evaluate(compile(attn), Q = q, K = q, V = v);
#endif
  (void)out;
  (void)vd;
}
