// cuda::evaluate launches a kernel: its inputs must be device memory
// (cuda::tensor, cuda::device_view). Host tensors are a compile error that
// says how to copy them, not an invalid pointer at run time.
// expect: bind device memory
// expect: cuda::to_device
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto M = dim<"M", 4>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
int main() {
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
#ifdef LINA_COMPILE_FAIL
  auto q = tensor<float>::random({1, 1, 3, 8}, 1), v = tensor<float>::random({1, 1, 3, 4}, 2);
  auto out = cuda::evaluate(plan, nullptr, Q = q, K = q, V = v);
#else
  cuda::tensor<float> q, v;  // empty: nothing allocated, nothing run
  auto f = [&] { return cuda::evaluate(plan, nullptr, Q = q, K = q, V = v); };
  auto out = 0;
  (void)f;
#endif
  (void)out;
}
