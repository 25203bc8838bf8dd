// A block's forward through a state and a tape of floats, given inputs of doubles.
// expect: the state, the tape, the output and the inputs must have one element type
// errors: 1
#include "_prelude.hpp"
int main() {
  auto plan = compile<order::linear>(attn);
  tensor<float> q({1, 1, 4, 32}), v({1, 1, 4, 16});
  tensor<double> qd({1, 1, 4, 32}), vd({1, 1, 4, 16});
  cpu::state<float> st;
  cpu::tape<float> tp;
#ifdef LINA_COMPILE_FAIL
  auto out = cpu::evaluate(plan, st, tp, Q = qd, K = qd, V = vd);
#else
  auto out = cpu::evaluate(plan, st, tp, Q = q, K = q, V = v);
#endif
  (void)out;
  (void)qd;
  (void)vd;
}
