// The gradient of a stacked plan is taken one layer at a time; layers that
// share an input (here K in both) would need their gradients added, which the
// CUDA backend does not do yet: one compile error naming the CPU's gradient.
// expect: the layers of this stacked plan share an input
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
constexpr auto V2 = input<"V2">(N, D);
constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
int main() {
  tensor<float> x({1, 1, 4, 8});
#ifdef LINA_COMPILE_FAIL
  auto g = cuda::emulate_gradient(compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K)))) * V2),
                                  {}, x, Q = x, K = x, V = x, V2 = x);
#else
  auto g = cuda::emulate_gradient(compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2),
                                  {}, x, Q = x, K = x, V = x, K2 = x, V2 = x);
#endif
  (void)g;
}
