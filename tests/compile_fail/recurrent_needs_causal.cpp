// Recurrent mode of a non-causal expression: there is no running state.
// expect: has no prefix scan: without causal\(\.\.\.\) every output reads every token
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto e = normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V;
#else
  constexpr auto e = attn;
#endif
  auto rnn = cpu::recurrent<float>(compile(e), 1, 2);
  (void)rnn;
}
