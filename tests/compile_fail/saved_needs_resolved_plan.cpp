// save_for_backward of a plan that still chooses its order at run time: the
// values kept depend on the order that runs (cpu::tape resolves it first).
// expect: resolve the plan's selects first
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto s = save_for_backward(compile(attn));
#else
  auto s = save_for_backward(compile<order::linear>(attn));
#endif
  (void)s;
}
