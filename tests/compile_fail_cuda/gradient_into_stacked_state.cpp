// A stacked plan chains through a state and decodes on the CUDA backend (one
// state per layer), but has no chained gradient there yet (∂state would have
// to run back through every layer's state): asking for one is a compile error
// that says what to do instead.
// expect: a stacked plan runs one kernel per layer, chains through a state
// expect: no chained gradient yet.*cuda::gradient without states
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
  cuda::state s0(cuda::memory::host), ds1(cuda::memory::host);
#ifdef LINA_COMPILE_FAIL
  auto g = cuda::emulate_gradient(compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V),
                                  {}, q, s0, ds1, Q = q, K = q, V = q, K2 = q);
#else
  auto g = cuda::emulate_gradient(compile(layer1), {}, q, s0, ds1, Q = q, K = q, V = q);
#endif
  (void)g;
}
