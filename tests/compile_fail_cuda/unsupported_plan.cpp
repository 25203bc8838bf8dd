// A plan the CUDA backend cannot lower yet (φ(Q) and φ(K) with random
// projections of their own: the kernel reads one W) is a compile error that
// lists the supported plan shapes, not a silent fallback.
// expect: this plan cannot be lowered to a CUDA kernel yet
// errors: 1
#include <lina/cuda.hpp>
#include <lina/lina.hpp>

using namespace lina;
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 32>;
constexpr auto M = dim<"M", 16>;
constexpr auto F = dim<"F", 64>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto W = input<"W">(D, F);
constexpr auto W2 = input<"W2">(D, F);
int main() {
#ifdef LINA_COMPILE_FAIL
  auto s = cuda::spec_of(compile(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)))) * V));
#else
  auto s = cuda::spec_of(compile(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V));
#endif
  (void)s;
}
