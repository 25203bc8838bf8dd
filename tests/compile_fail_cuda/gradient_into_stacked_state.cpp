// A stacked plan's chained gradient (one state per layer) comes in new
// tensors, as its stateless one does: the gradients are sums of its layers'
// shares. Asking for them in the caller's views — chained, on the device — is
// the compile error of gradient_into without states, naming cuda::gradient.
// expect: a stacked plan's gradients are the sums of its layers' shares.*call cuda::gradient
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
  cuda::tensor<float> q({1, 1, 4, 8});
  cuda::state s0, ds1;
#ifdef LINA_COMPILE_FAIL
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V);
  auto into = cuda::gradient_views<float>(plan);
  auto d0 = cuda::gradient_into(plan, into, q, s0, ds1, nullptr, Q = q, K = q, V = q, K2 = q);
#else
  constexpr auto plan = compile(layer1);
  auto into = cuda::gradient_views<float>(plan);
  auto d0 = cuda::gradient_into(plan, into, q, s0, ds1, nullptr, Q = q, K = q, V = q);
#endif
  (void)d0;
}
