// The backward kernel writes ∂Q, ∂K and ∂V to three inputs; a plan that reads
// one input twice (K as V here) would need two gradients added: one compile
// error instead of a silently wrong gradient.
// expect: a plan that reads one input
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
int main() {
  tensor<float> x({1, 1, 4, 8});
#ifdef LINA_COMPILE_FAIL
  auto g = cuda::emulate_gradient(compile<order::linear>(causal(Q * transpose(K)) * K), {}, x, Q = x, K = x);
#else
  auto g = cuda::emulate_gradient(compile<order::linear>(causal(Q * transpose(K)) * V), {}, x, Q = x, K = x, V = x);
#endif
  (void)g;
}
