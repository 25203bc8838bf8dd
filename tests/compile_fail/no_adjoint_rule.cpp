// Differentiating a backward expression: its nodes have no adjoint rule.
// expect: no adjoint rule for this node
// expect: lina::diagnose::adjoint_rule<lina::op::
// errors: 1
#include "_prelude.hpp"
int main() {
  constexpr auto backward = gradient(compile<order::linear>(attn));
#ifdef LINA_COMPILE_FAIL
  auto twice = gradient(backward[Q]);
#else
  auto twice = gradient(compile(attn));
#endif
  (void)twice;
}
