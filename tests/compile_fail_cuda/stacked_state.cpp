// A stacked plan chains through a state on the CUDA backend (one state per
// layer), but does not decode token by token there yet (its step would run a
// kernel per layer on each token): cuda::recurrent of a stack is a compile
// error that says what to use instead.
// expect: a stacked plan runs one kernel per layer and chains through a state
// expect: not yet in decoding steps.*cpu::recurrent
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
#ifdef LINA_COMPILE_FAIL
  auto rnn = cuda::recurrent(compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V), 1,
                             1, {}, cuda::memory::host);
#else
  auto rnn = cuda::recurrent(compile(layer1), 1, 1, {}, cuda::memory::host);
#endif
  (void)rnn;
}
