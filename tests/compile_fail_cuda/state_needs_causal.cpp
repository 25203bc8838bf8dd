// A state chains causal attention only: a non-causal plan has no running
// state (every row reads the whole sequence), so giving it one is the CPU
// backend's compile error (lina/state.hpp), not a run-time surprise.
// expect: need a causal linear plan
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
  auto q = tensor<float>::random({1, 1, 3, 8}, 1), v = tensor<float>::random({1, 1, 3, 4}, 2);
  cuda::state st(cuda::memory::host);
#ifdef LINA_COMPILE_FAIL
  auto out = cuda::emulate(compile(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V), {}, st, Q = q, K = q, V = v);
#else
  auto out = cuda::emulate(compile(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * V), {}, st, Q = q, K = q, V = v);
#endif
  (void)out;
}
