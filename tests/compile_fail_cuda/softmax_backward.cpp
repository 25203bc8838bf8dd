// Softmax attention runs forward on the CUDA backend, but its backward kernel
// is not generated yet: asking for its gradient is one compile error that
// says where to differentiate it instead.
// expect: the backward of softmax attention is not generated yet
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
int main() {
  tensor<float> q({1, 1, 4, 16}), dout({1, 1, 4, 16});
#ifdef LINA_COMPILE_FAIL
  auto g = cuda::emulate_gradient(compile(normalize(causal(exp(Q * transpose(K) * 0.25))) * V), {}, dout, Q = q, K = q, V = q);
#else
  auto g = cuda::emulate_gradient(compile<order::linear>(normalize(causal(Q * transpose(K))) * V), {}, dout, Q = q, K = q, V = q);
#endif
  (void)g;
}
