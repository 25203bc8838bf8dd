// A random-feature map used without its projection.
// expect: this map is parametric \(random features\); pass its projection
// errors: 1
#include "_prelude.hpp"
int main() {
  constexpr auto F = dim<"F", 64>;
  constexpr auto W = input<"W">(D, F);
#ifdef LINA_COMPILE_FAIL
  auto e = phi<favor>(Q);
#else
  auto e = phi<favor>(Q, W);
#endif
  (void)e;
}
