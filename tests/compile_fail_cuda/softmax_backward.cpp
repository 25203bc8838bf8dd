// Softmax attention is differentiated on the CUDA backend, but not with a
// parametric map inside exp (its ∂W would sum over every block): asking for
// that gradient is one compile error that says what to do instead.
// expect: with favor or random_fourier inside exp is not generated yet
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
constexpr auto W = input<"W">(D, dim<"F", 8>);
int main() {
  tensor<float> q({1, 1, 4, 16}), w({1, 1, 16, 8}), dout({1, 1, 4, 16});
#ifdef LINA_COMPILE_FAIL
  auto g = cuda::emulate_gradient(compile(normalize(causal(exp(phi<favor>(Q, W) * transpose(phi<favor>(K, W))))) * V),
                                  {}, dout, Q = q, K = q, V = q, W = w);
#else
  auto g = cuda::emulate_gradient(compile(normalize(causal(exp(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))))) * V),
                                  {}, dout, Q = q, K = q, V = q);
#endif
  (void)g;
}
