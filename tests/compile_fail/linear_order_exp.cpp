// Softmax (exp) has no finite feature map: no linear order.
// expect: exp\(\.\.\.\) has no finite feature map
// errors: 1
#include "_prelude.hpp"
int main() {
  constexpr auto softmax = normalize(exp(Q * transpose(K) * 0.17)) * V;
#ifdef LINA_COMPILE_FAIL
  auto plan = compile<order::linear>(softmax);
#else
  auto plan = compile(softmax);
#endif
  (void)plan;
}
