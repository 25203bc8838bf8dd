// Derived gradients: the forward plan and the backward plan lina derives from
// it, for the linear and the quadratic order; then one gradient checked
// against central finite differences, and the backward's extra memory.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
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

  // One gradient against central differences of L = sum(dout ⊙ out), in double.
  std::size_t n = 64;
  auto q = tensor<double>::random({1, 2, n, 8}, 1), k = tensor<double>::random({1, 2, n, 8}, 2);
  auto v = tensor<double>::random({1, 2, n, 4}, 3), dout = tensor<double>::random({1, 2, n, 4}, 4);
  auto g = cpu::gradient(compile(attn), dout, Q = q, K = k, V = v);
  auto loss = [&] {
    auto out = cpu::evaluate(attn, Q = q, K = k, V = v);  // as written: the oracle
    double s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += out.data()[i] * dout.data()[i];
    return s;
  };
  double worst = 0, h = 1e-6;
  for (std::size_t i = 0; i < k.size(); i += 7) {
    double keep = k.data()[i];
    k.data()[i] = keep + h;
    double up = loss();
    k.data()[i] = keep - h;
    double down = loss();
    k.data()[i] = keep;
    double fd = (up - down) / (2 * h);
    worst = std::max(worst, std::abs(fd - g[K].data()[i]) / (1 + std::abs(fd)));
  }
  fmt::print("∂L/∂K at N = {} vs central differences (h = 1e-6, every 7th entry): max relative error {:.2e}\n", n,
             worst);

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
}
