// Recurrent mode of softmax attention: exp has no finite feature map.
// expect: recurrent mode needs a finite feature map: exp\(\.\.\.\) \(softmax\) has none
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto e = normalize(causal(exp(Q * transpose(K) * 0.17))) * V;
#else
  constexpr auto e = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
#endif
  cpu::state<float> st;
  tensor<float> q({1, 1, 3, 32}), v({1, 1, 3, 16});
  auto out = cpu::evaluate(compile(e), st, Q = q, K = q, V = v);
  (void)out;
}
