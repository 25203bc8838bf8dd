// A decay outside [0, 1] in a constant expression: the refusal that throws at
// run time is a compile error here, at the throw, whose text names the range.
// expect: gamma must be in \[0, 1\]
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto e = causal(Q * transpose(K), decay{2}) * V;
#else
  constexpr auto e = causal(Q * transpose(K), decay{0.5}) * V;
#endif
  (void)e;
}
