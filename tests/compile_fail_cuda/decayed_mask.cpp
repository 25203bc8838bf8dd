// A decayed mask lowers outside exp (linear attention, and softmax with ALiBi's
// bias causal(exp(S), decay{g})); a decayed mask inside exp — scores weighed by
// g^(i−j) before exp, which no kernel computes — is a compile error that says
// where it runs, not a kernel without the decay.
// expect: this plan cannot be lowered to a CUDA kernel yet
// expect: inside exp.*runs on the CPU backend
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
  auto s = cuda::spec_of(compile(normalize(exp(causal(Q * transpose(K) * 0.25, decay{0.9}))) * V));
#else
  auto s = cuda::spec_of(compile(normalize(causal(exp(Q * transpose(K) * 0.25), decay{0.9})) * V));
#endif
  (void)s;
}
