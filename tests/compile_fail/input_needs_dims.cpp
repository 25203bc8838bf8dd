// input<"name">(rows, cols) with a number instead of a dimension.
// expect: both extents must be dimensions made with lina::dim
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto X = input<"X">(N, 32);
#else
  auto X = input<"X">(N, D);
#endif
  (void)X;
}
