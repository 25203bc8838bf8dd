// A plan the CUDA backend cannot lower (a user-defined feature map: the kernel
// would need its formula in CUDA) is a compile error that lists the supported
// plan shapes, not a silent fallback.
// expect: this plan cannot be lowered to a CUDA kernel yet
// errors: 1
#include <cmath>
#include <lina/cuda.hpp>
#include <lina/lina.hpp>
#include <string_view>

using namespace lina;
struct softplus {
  static constexpr std::string_view name = "softplus";
  template <class T> static T value(T x) { return std::log1p(std::exp(x)); }
  template <class T> static T derivative(T x) { return 1 / (1 + std::exp(-x)); }
};
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 32>;
constexpr auto M = dim<"M", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
int main() {
#ifdef LINA_COMPILE_FAIL
  auto s = cuda::spec_of(compile(normalize(causal(phi<softplus>(Q) * transpose(phi<softplus>(K)))) * V));
#else
  auto s = cuda::spec_of(compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V));
#endif
  (void)s;
}
