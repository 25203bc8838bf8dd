// The same dimension name declared with two static extents.
// expect: declared with two different static extents
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto D64 = dim<"D", 64>;
#else
  constexpr auto D64 = dim<"D", 32>;
#endif
  auto W = input<"W">(D64, M);
  auto e = Q * W;
  (void)e;
}
