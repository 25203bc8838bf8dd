// A stacked plan chains through a state and decodes on the CUDA backend (one
// state per layer), but not yet with packed sequences and a state (each
// sequence's rows through every layer in turn): that is a compile error that
// says what to use instead.
// expect: a stacked plan runs one kernel per layer, chains through a state
// expect: not yet.*packed sequences and a state.*use the CPU backend
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
  auto seqs = sequences::from_lengths({1, 3});
#ifdef LINA_COMPILE_FAIL
  cuda::emulate_into(compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V), {},
                     out.view(), st, seqs, Q = q, K = q, V = q, K2 = q);
#else
  cuda::emulate_into(compile(layer1), {}, out.view(), st, seqs, Q = q, K = q, V = q);
#endif
}
