// estimate() of a plan with a dynamic dimension left without an extent.
// expect: give an extent for every dynamic dimension of the plan
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto c = estimate(compile(attn));
#else
  auto c = estimate(compile(attn), N = 128);
#endif
  (void)c;
}
