// kernels_of lists one layer's kernels: a stacked plan is one static_assert
// that says to list each layer (whose extents differ) on its own.
// expect: list each layer's attention
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, D);
constexpr auto layer = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
int main() {
#ifdef LINA_COMPILE_FAIL
  auto ks = cuda::kernels_of(compile(normalize(causal(phi<elu_plus_one>(layer) * transpose(phi<elu_plus_one>(K)))) * V), {});
#else
  auto ks = cuda::kernels_of(compile(layer), {});
#endif
  return ks.empty() ? 1 : 0;
}
