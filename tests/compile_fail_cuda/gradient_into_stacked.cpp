// gradient_into writes each gradient into the caller's view; a stacked plan's
// gradients are sums of its layers' shares made in new tensors, so asking for
// them in place is a compile error that names cuda::gradient instead.
// expect: call cuda::gradient
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
constexpr auto K2 = input<"K2">(N, D);
constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
int main() {
  tensor<float> q({1, 1, 4, 8});
#ifdef LINA_COMPILE_FAIL
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V);
  auto into = cuda::emulate_gradient_views(plan);
  cuda::emulate_gradient_into(plan, {}, into, q, Q = q, K = q, V = q, K2 = q);
#else
  constexpr auto plan = compile(layer1);
  auto into = cuda::emulate_gradient_views(plan);
  cuda::emulate_gradient_into(plan, {}, into, q, Q = q, K = q, V = q);
#endif
}
