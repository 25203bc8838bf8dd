// A * B with the columns of A not the rows of B.
// expect: A \* B needs the columns of A to be the same dimension as the rows of B
// expect: product_inner_dimensions<lina::dim_t<lina::fixed_string<2>\{"D"\}, 32>, lina::dim_t<lina::fixed_string<2>\{"N"\}
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto e = Q * V;
#else
  auto e = Q * transpose(K);
#endif
  (void)e;
}
