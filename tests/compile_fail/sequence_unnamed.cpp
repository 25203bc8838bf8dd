// Where the structure does not tell the sequence dimension (here two sums
// over tokens, over N and over L), the user names it.
// expect: the sequence dimension cannot be told
// errors: 1
#include "_prelude.hpp"
int main() {
  constexpr auto L = dim<"L">;
  constexpr auto P = dim<"P">;
  constexpr auto C = input<"C">(L, M);
  constexpr auto E = input<"E">(L, P);
  constexpr auto two_sums = transpose(Q) * V * transpose(C) * E;  // (D x N)(N x M)(M x L)(L x P)
#ifdef LINA_COMPILE_FAIL
  auto plan = compile(two_sums);
#else
  auto plan = compile(two_sums, L);
#endif
  (void)plan;
}
