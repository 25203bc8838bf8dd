// lina::check compiles every order, so, like compile, it needs the sequence
// dimension named where the structure does not tell it.
// expect: lina::check: the sequence dimension cannot be told
// errors: 1
#include <lina/check.hpp>

#include "_prelude.hpp"
int main() {
  constexpr auto L = dim<"L">;
  constexpr auto P = dim<"P">;
  constexpr auto C = input<"C">(L, M);
  constexpr auto E = input<"E">(L, P);
  constexpr auto two_sums = transpose(Q) * V * transpose(C) * E;  // (D x N)(N x M)(M x L)(L x P)
#ifdef LINA_COMPILE_FAIL
  auto r = check::orderings(two_sums);
#else
  auto r = check::orderings(two_sums, L);
#endif
  (void)r;
}
