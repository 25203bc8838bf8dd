// An input named "dout" clashes with the output's cotangent.
// expect: "dout" names the output's cotangent
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  constexpr auto W = input<"dout">(N, M);
#else
  constexpr auto W = input<"W">(N, M);
#endif
  auto g = gradient(compile(normalize(causal(Q * transpose(K))) * W));
  (void)g;
}
