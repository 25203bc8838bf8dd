// favor and random Fourier features run forward on the CUDA backend, but the
// backward kernel (with the gradient of W) is not generated yet: asking for
// it is one compile error that says where to differentiate instead.
// expect: the backward of a parametric feature map
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto F = dim<"F", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
constexpr auto W = input<"W">(D, F);
int main() {
  tensor<float> q({1, 1, 4, 8}), w({1, 1, 8, 16}), dout({1, 1, 4, 8});
#ifdef LINA_COMPILE_FAIL
  auto g = cuda::emulate_gradient(compile<order::linear>(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V),
                                  {}, dout, Q = q, K = q, V = q, W = w);
#else
  auto g = cuda::emulate_gradient(compile<order::linear>(normalize(causal(Q * transpose(K))) * V), {}, dout, Q = q, K = q, V = q);
#endif
  (void)g;
}
