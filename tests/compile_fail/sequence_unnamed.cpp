// Where the structure does not tell the sequence dimension (no causal mask,
// no square similarity, inputs with different rows), the user names it.
// expect: the sequence dimension cannot be told
// errors: 1
#include "_prelude.hpp"
int main() {
  constexpr auto F = dim<"F">;
  constexpr auto W = input<"W">(D, F);
  constexpr auto linear = phi<favor>(Q, W) * (transpose(phi<favor>(K, W)) * V);
#ifdef LINA_COMPILE_FAIL
  auto plan = compile(linear);
#else
  auto plan = compile(linear, N);
#endif
  (void)plan;
}
