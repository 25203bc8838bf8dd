// A stacked plan runs on the CUDA backend one kernel per layer, but not
// chained through a state yet (it would need one per layer): giving it one is
// a compile error that says what to use instead.
// expect: a stacked plan runs one kernel per layer
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
  tensor<float> q({1, 1, 4, 8}), out({1, 1, 4, 8});
  cuda::state st(cuda::memory::host);
#ifdef LINA_COMPILE_FAIL
  cuda::emulate_into(compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V), {},
                     out.view(), st, Q = q, K = q, V = q, K2 = q);
#else
  cuda::emulate_into(compile(layer1), {}, out.view(), st, Q = q, K = q, V = q);
#endif
}
