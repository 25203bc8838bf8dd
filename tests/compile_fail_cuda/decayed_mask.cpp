// A decayed causal mask has no CUDA kernel yet (none decays its state): a
// compile error that says so and where it runs, not a kernel without the decay.
// expect: this plan cannot be lowered to a CUDA kernel yet
// expect: runs on the CPU backend only
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 32>;
constexpr auto M = dim<"M", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
int main() {
#ifdef LINA_COMPILE_FAIL
  auto s = cuda::spec_of(compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V));
#else
  auto s = cuda::spec_of(compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V));
#endif
  (void)s;
}
