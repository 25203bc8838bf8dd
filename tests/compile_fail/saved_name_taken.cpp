// An input named saved<number> clashes with the values a forward keeps for its backward.
// expect: saved1, saved2, … name the values the forward keeps
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto W = input<"saved2">(N, M);
#else
  constexpr auto W = input<"W">(N, M);
#endif
  auto s = save_for_backward(compile<order::linear>(normalize(causal(Q * transpose(K))) * W));
  (void)s;
}
