// A W shared by batch and heads, broadcast from a temporary: the view would dangle.
// expect: lina::broadcast returns a view of its tensor, which a temporary would leave dangling
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto w = broadcast(gaussian_projection<float>(32, 64, 1), 2, 4);
#else
  auto const projection = gaussian_projection<float>(32, 64, 1);
  auto w = broadcast(projection, 2, 4);
#endif
  (void)w;
}
