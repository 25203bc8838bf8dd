// lina::check::recurrent of a non-causal expression: no running state to step
// with, said once, as cpu::recurrent says it.
// expect: recurrent mode and stateful evaluation need a causal linear plan
// errors: 1
#include <lina/check.hpp>

#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto e = normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V;
#else
  constexpr auto e = attn;
#endif
  auto r = check::recurrent(e, {.trials = 1});
  (void)r;
}
