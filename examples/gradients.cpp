// Derived gradients: the forward plan and the backward plan lina derives from
// it, for the linear and the quadratic order, and the linear backward that
// reads what a training forward kept (cpu::tape); then every order's gradients
// checked against central finite differences, and the backward's extra memory.
#include <fmt/core.h>

#include <lina/check.hpp>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <sstream>
#include <string>
#include <vector>

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto M = dim<"M", 4>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;

std::vector<std::string> lines(std::string const& s) {
  std::vector<std::string> r;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) r.push_back(l);
  return r;
}

template <class Plan>
void side_by_side(char const* title, Plan const& plan) {
  fmt::print("{}\n  forward   {}\n", title, plan);
  auto back = lines(to_string(gradient(plan)));
  for (std::size_t i = 0; i < back.size(); ++i) fmt::print("  {:9} {}\n", i == 0 ? "backward" : "", back[i]);
  fmt::print("\n");
}
}  // namespace

int main() {
  fmt::print("expression: {}\n\n", attn);
  side_by_side("linear order", compile<order::linear>(attn));
  side_by_side("quadratic order", compile<order::quadratic>(attn));
  // In training the forward has just run: a cpu::tape keeps Y, and the
  // backward reads it (saved1) instead of running that scan again.
  auto saving = lines(to_string(save_for_backward(compile<order::linear>(attn))));
  fmt::print("linear order, reading what the forward kept (cpu::tape)\n");
  for (std::size_t i = 0; i < saving.size(); ++i) fmt::print("  {:9} {}\n", i == 0 ? "backward" : "", saving[i]);
  fmt::print("\n");

  // Every order's gradients against central differences of L = sum(dout ⊙ out)
  // in double, at random extents (N up to 64): lina::check, what to run on a
  // variant of your own (a map's hand-written derivative, say).
  auto report = check::gradients(attn, {.trials = 2, .max_extent = 64});
  fmt::print("{}\n", report.str());

  // The backward's extra memory: temporaries beyond inputs, dout and gradients.
  // (Finished calls keep their buffers for the next ones; released first, so
  // that each line counts its own call.)
  for (std::size_t len : {4096u, 16384u}) {
    auto ql = tensor<float>::random({1, 1, len, 8}, 5), vl = tensor<float>::random({1, 1, len, 4}, 6);
    cpu::release_cached_memory();
    cpu::memory().reset();
    auto gl = cpu::gradient(compile<order::linear>(attn), vl, Q = ql, K = ql, V = vl);
    fmt::print("linear backward, N = {:5}: peak temporaries {:7.1f} KiB (an N x N float matrix would be {:.0f} MiB)\n",
               len, cpu::memory().peak / 1024.0, double(len) * double(len) * 4 / (1 << 20));
  }
  return report.ok() ? 0 : 1;
}
