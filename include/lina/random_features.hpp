// Parameters of the random-feature maps (favor, random_fourier): a D x m
// projection W, drawn from a seed, bound like any input (W = w), so it can be
// redrawn between evaluations. broadcast() shares one W across batch and
// heads without copies (a view with zero strides).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lina/tensor.hpp"

namespace lina {

namespace detail {
// Standard normal deviates (Box-Muller over splitmix64): identical everywhere.
struct normal_source {
  std::uint64_t s;
  double uniform() {  // in (0, 1)
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
  }
  double next() {
    double u = uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586477 * v);
  }
};
}  // namespace detail

// W: [1, 1, d, m], columns w_j with N(0, I_d) marginals. With `orthogonal`,
// each block of d columns is orthogonalised (Gram-Schmidt) and every column
// rescaled to the norm of an independent Gaussian vector (Performer's
// orthogonal random features: same marginals, lower variance).
template <class T>
tensor<T> gaussian_projection(std::size_t d, std::size_t m, std::uint64_t seed, bool orthogonal = true) {
  detail::normal_source rng{seed * 0xD1B54A32D192ED03ull + 1};
  std::vector<double> w(d * m);
  for (auto& x : w) x = rng.next();
  if (orthogonal) {
    for (std::size_t block = 0; block < m; block += d) {
      std::size_t end = std::min(m, block + d);
      for (std::size_t j = block; j < end; ++j) {
        for (std::size_t p = block; p < j; ++p) {  // remove the components along earlier columns
          double dot = 0;
          for (std::size_t i = 0; i < d; ++i) dot += w[i * m + j] * w[i * m + p];
          for (std::size_t i = 0; i < d; ++i) w[i * m + j] -= dot * w[i * m + p];
        }
        double norm = 0;
        for (std::size_t i = 0; i < d; ++i) norm += w[i * m + j] * w[i * m + j];
        norm = std::sqrt(norm);
        for (std::size_t i = 0; i < d; ++i) w[i * m + j] /= norm;  // unit, for the next columns
      }
      for (std::size_t j = block; j < end; ++j) {
        double chi = 0;
        for (std::size_t i = 0; i < d; ++i) {
          double g = rng.next();
          chi += g * g;
        }
        chi = std::sqrt(chi);
        for (std::size_t i = 0; i < d; ++i) w[i * m + j] *= chi;
      }
    }
  }
  tensor<T> out({1, 1, d, m});
  for (std::size_t i = 0; i < d * m; ++i) out.data()[i] = static_cast<T>(w[i]);
  return out;
}

// A [1, 1, r, c] tensor seen as [batch, heads, r, c] without copies.
template <class T>
tensor_view<T const> broadcast(tensor<T> const& t, std::size_t batch, std::size_t heads) {
  auto s = t.strides();
  return {t.data(), {batch, heads, t.shape()[2], t.shape()[3]}, {0, 0, s[2], s[3]}};
}
// A view of a temporary would dangle at the end of the statement (and read
// freed memory when bound later): refused at compile time.
template <class T>
tensor_view<T const> broadcast(tensor<T>&&, std::size_t, std::size_t) {
  static_assert(sizeof(T) == 0,
                "lina::broadcast returns a view of its tensor, which a temporary would leave dangling: keep the tensor "
                "in a variable first (auto w = gaussian_projection<float>(d, f, seed); ... W = broadcast(w, B, H))");
  return {};
}

}  // namespace lina
