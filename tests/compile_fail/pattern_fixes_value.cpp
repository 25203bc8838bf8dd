// A rewrite pattern may not fix an op's value (matching is on types, and
// would ignore it): match the op with an op variable instead.
// expect: a pattern node carries a value
// errors: 1
#include "_prelude.hpp"
int main() {
  using namespace lina::rewrite;
#ifdef LINA_COMPILE_FAIL
  auto m = match(normalize(x_, 0.5), normalize(Q));
#else
  auto m = match(normalize_(x_), normalize(Q));
#endif
  (void)m;
}
