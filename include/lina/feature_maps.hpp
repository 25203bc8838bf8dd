// Feature maps φ, applied to every row of a matrix: phi<Map>(X).
//
// A map is a small struct. The element-wise kind (C = D features) declares
//
//   struct my_map {
//     static constexpr std::string_view name = "my_map";
//     template <class T> static T value(T x);       // φ(x)
//     template <class T> static T derivative(T x);  // φ'(x), for gradients
//   };
//
// and the row kind (C = features(D), e.g. polynomial or random features) declares
//
//   struct my_row_map {
//     static constexpr std::string_view name = "my_row_map";
//     static constexpr std::size_t features(std::size_t d);        // C as a function of D
//     template <class T> static void apply(T const* x, std::size_t d, T* out);  // out[0,C) = φ(x[0,d))
//     template <class T> static void vjp(T const* x, std::size_t d, T const* g, T* dx);  // dx = J_φ(x)ᵀ g
//   };
//
// and the parametric kind (random features) takes a parameter matrix W (D x m),
// bound like any input, phi<Map>(X, W), and has C = features(m):
//
//   struct my_random_map {
//     static constexpr std::string_view name = "mine";
//     static constexpr std::size_t features(std::size_t m);
//     template <class T> static void apply(T const* x, std::size_t d, T const* w, std::size_t m, T* out);
//     template <class T> static void vjp(T const* x, std::size_t d, T const* w, std::size_t m, T const* g, T* dx);
//     // h (m entries) with ∂L/∂W = Σ_rows x hᵀ, for the gradient of W
//     template <class T> static void param_vjp(T const* x, std::size_t d, T const* w, std::size_t m, T const* g, T* h);
//   };
//
// (w is row-major: w[i * m + j].) NaN inputs must give NaN outputs: compare
// so that NaN falls through.
//
// A parametric map that is the projection z = x·W (each z_j summed over i in
// order) followed by a function of the row may say so with
//     template <class T> static void finish(T const* x, std::size_t d, std::size_t m, T* out);
// (out[0, m) holds z on entry, the features on exit): a backend then projects
// every row at once, as one product, instead of calling apply row by row.
// Its gradients may then come from the features' values, which the backward
// has already made (the forward's φ(X; W), or a tape's), so that it needs
// no Z at all: declare
//     template <class T> static void grad_z(std::size_t d, std::size_t m, T const* phi, T const* g, T* h);
// (h[0, m) = ∂L/∂z from the row's features φ and their cotangent g) and, where
// the features also depend on x outside z,
//     template <class T> static void grad_x(T const* x, std::size_t d, std::size_t m, T const* h, T* dx);
// (add to dx[0, d), which holds W·h on entry, the rest of ∂L/∂x, from x and
// h). The derived backward then makes H = ∂L/∂Z once per φ node and reads it
// twice: ∂X = H·Wᵀ (+ grad_x) and ∂W = Xᵀ·H, both products.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <string_view>
#include <vector>

#include "lina/detail/each_lane.hpp"
#include "lina/detail/exp.hpp"
#include "lina/detail/madd.hpp"

namespace lina {

namespace detail {
// out[0, m) = z = x·W (w row-major, d x m), a row of W at a time: contiguous,
// vectorised over j, and each z_j summed over i in order, fused, as the CPU
// backend's product of all rows sums it (the same bits), so that a map's
// apply and its finish after that product agree.
template <class T>
void project(T const* x, std::size_t d, T const* w, std::size_t m, T* out) {
  for (std::size_t j = 0; j < m; ++j) out[j] = 0;
  for (std::size_t i = 0; i < d; ++i) {
    T const xi = x[i];
    T const* wi = w + i * m;
    each_lane(out, m, [wi, xi, out](std::size_t j) { return madd(wi[j], xi, out[j]); });
  }
}
}  // namespace detail

namespace concepts {

template <class M>
concept elementwise_map = requires(double x, float y) {
  { M::name } -> std::convertible_to<std::string_view>;
  { M::value(x) } -> std::same_as<double>;
  { M::derivative(x) } -> std::same_as<double>;
  { M::value(y) } -> std::same_as<float>;
  { M::derivative(y) } -> std::same_as<float>;
};

template <class M>
concept row_map = requires(std::size_t d, double const* x, double const* g, double* out) {
  { M::name } -> std::convertible_to<std::string_view>;
  { M::features(d) } -> std::same_as<std::size_t>;
  M::apply(x, d, out);
  M::vjp(x, d, g, out);
};

template <class M>
concept parametric_map = requires(std::size_t d, double const* x, double const* w, double const* g, double* out) {
  { M::name } -> std::convertible_to<std::string_view>;
  { M::features(d) } -> std::same_as<std::size_t>;
  M::apply(x, d, w, d, out);
  M::vjp(x, d, w, d, g, out);
  M::param_vjp(x, d, w, d, g, out);
};

// A parametric map differentiated from its features' values (above).
template <class M>
concept value_differentiable = parametric_map<M> && requires(std::size_t d, double const* p, double* h) {
  M::grad_z(d, d, p, p, h);
};

template <class M>
concept feature_map = elementwise_map<M> || row_map<M> || parametric_map<M>;

}  // namespace concepts

// elu(x) + 1: the paper's map; positive, so normalisers stay positive.
struct elu_plus_one {
  static constexpr std::string_view name = "elu+1";
  template <class T>
  static constexpr T value(T x) {
    return x > T(0) ? x + T(1) : detail::exp_min0(x);  // a vectorisable exp of what is not above 0 (detail/exp.hpp)
  }
  template <class T>
  static constexpr T derivative(T x) {
    return x > T(0) ? T(1) : detail::exp_min0(x);
  }
};

// max(x, 0); non-negative, can be all zero (then the normaliser is eps alone).
struct relu {
  static constexpr std::string_view name = "relu";
  template <class T>
  static constexpr T value(T x) {
    return x < T(0) ? T(0) : x;  // NaN passes through
  }
  // 1 above 0, 0 at or below it, NaN for NaN: two selects, which compilers
  // make vector blends (three nested ones became branches, mispredicted on
  // signed inputs: the backward ran 1.5x slower than elu+1's).
  template <class T>
  static constexpr T derivative(T x) {
    T const step = x > T(0) ? T(1) : T(0);
    return x == x ? step : x;
  }
};

// φ(x) = x: plain (unnormalised or signed) linear attention.
struct identity {
  static constexpr std::string_view name = "id";
  template <class T>
  static constexpr T value(T x) {
    return x;
  }
  template <class T>
  static constexpr T derivative(T x) {
    return x == x ? T(1) : x;
  }
};

// The exact degree-2 polynomial kernel: φ(x)·φ(y) = (x·y)², with the
// symmetric packing [x_i² (i), √2 x_i x_j (i < j)], C = D(D+1)/2.
struct poly2 {
  static constexpr std::string_view name = "poly2";
  static constexpr std::size_t features(std::size_t d) { return d * (d + 1) / 2; }
  template <class T>
  static void apply(T const* x, std::size_t d, T* out) {
    T const r2 = static_cast<T>(1.4142135623730950488);
    std::size_t k = 0;
    for (std::size_t i = 0; i < d; ++i) {
      out[k++] = x[i] * x[i];
      T const* after = x + i + 1;
      detail::each_lane(out + k, d - i - 1, [r2, xi = x[i], after](std::size_t j) { return r2 * xi * after[j]; });
      k += d - i - 1;
    }
  }
  template <class T>
  static void vjp(T const* x, std::size_t d, T const* g, T* dx) {
    T const r2 = static_cast<T>(1.4142135623730950488);
    for (std::size_t i = 0; i < d; ++i) dx[i] = T(0);
    std::size_t k = 0;
    for (std::size_t i = 0; i < d; ++i) {
      dx[i] += 2 * x[i] * g[k++];
      for (std::size_t j = i + 1; j < d; ++j, ++k) {
        dx[i] += r2 * x[j] * g[k];
        dx[j] += r2 * x[i] * g[k];
      }
    }
  }
};

// Performer's positive random features (FAVOR+): with x' = x D^-1/4,
// φ(x)_j = exp(w_j·x' - |x'|²/2) / √m, so E[φ(q)·φ(k)] = exp(q·k / √D), the
// softmax similarity. W (D x m) holds the projections w_j as columns;
// gaussian_projection(d, m, seed, true) draws them orthogonal.
struct favor {
  static constexpr std::string_view name = "favor";
  static constexpr std::size_t features(std::size_t m) { return m; }
  template <class T>
  static void apply(T const* x, std::size_t d, T const* w, std::size_t m, T* out) {
    detail::project(x, d, w, m, out);
    finish(x, d, m, out);
  }
  // out[j] = exp(z_j D^-1/4 - |x|² D^-1/2 / 2) / √m, from out[j] = z_j
  template <class T>
  static void finish(T const* x, std::size_t d, std::size_t m, T* out) {
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25)), inv = T(1) / std::sqrt(static_cast<T>(m));
    T half_norm = 0;
    for (std::size_t i = 0; i < d; ++i) half_norm += x[i] * x[i];
    half_norm *= s * s / 2;
    detail::each_lane(out, m, [s, half_norm, inv, out](std::size_t j) { return detail::exp(s * out[j] - half_norm) * inv; });
  }
  // ∂φ_j/∂x_i = φ_j (w_ij - x'_i) D^-1/4
  template <class T>
  static void vjp(T const* x, std::size_t d, T const* w, std::size_t m, T const* g, T* dx) {
    std::vector<T> phi(m);
    apply(x, d, w, m, phi.data());
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25));
    T gphi = 0;
    for (std::size_t j = 0; j < m; ++j) gphi += g[j] * phi[j];
    for (std::size_t i = 0; i < d; ++i) {
      T acc = 0;
      for (std::size_t j = 0; j < m; ++j) acc += w[i * m + j] * g[j] * phi[j];
      dx[i] = s * (acc - s * x[i] * gphi);
    }
  }
  // ∂φ_j/∂w_ij = φ_j x'_i: h_j = g_j φ_j D^-1/4
  template <class T>
  static void param_vjp(T const* x, std::size_t d, T const* w, std::size_t m, T const* g, T* h) {
    apply(x, d, w, m, h);
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25));
    detail::each_lane(h, m, [h, g, s](std::size_t j) { return h[j] * (g[j] * s); });
  }
  // From the features: h_j = g_j φ_j D^-1/4 (as param_vjp), and the part of
  // dx from |x'|²: -D^-1/2 x Σ_j g_j φ_j = -D^-1/4 x Σ_j h_j.
  template <class T>
  static void grad_z(std::size_t d, std::size_t m, T const* phi, T const* g, T* h) {
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25));
    detail::each_lane(h, m, [phi, g, s](std::size_t j) { return phi[j] * (g[j] * s); });
  }
  template <class T>
  static void grad_x(T const* x, std::size_t d, std::size_t m, T const* h, T* dx) {
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25));
    T sum = 0;
    for (std::size_t j = 0; j < m; ++j) sum += h[j];
    sum *= s;
    detail::each_lane(dx, d, [x, dx, sum](std::size_t i) { return dx[i] - x[i] * sum; });
  }
};

// Random Fourier features of the Gaussian kernel: with x' = x D^-1/4,
// φ(x) = [cos(w_j·x'), sin(w_j·x')]_j / √m, C = 2m, so
// E[φ(x)·φ(y)] = exp(-|x' - y'|² / 2). Signed: use it unnormalised, or
// with care (the row sums can approach zero).
struct random_fourier {
  static constexpr std::string_view name = "rff";
  static constexpr std::size_t features(std::size_t m) { return 2 * m; }
  template <class T>
  static void apply(T const* x, std::size_t d, T const* w, std::size_t m, T* out) {
    detail::project(x, d, w, m, out);
    finish(x, d, m, out);
  }
  // out[j] = cos(s z_j) / √m, out[m + j] = sin(s z_j) / √m, from out[j] = z_j
  template <class T>
  static void finish(T const* x, std::size_t d, std::size_t m, T* out) {
    (void)x;
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25)), inv = T(1) / std::sqrt(static_cast<T>(m));
    for (std::size_t j = 0; j < m; ++j) {
      T const zj = s * out[j];
      out[m + j] = std::sin(zj) * inv;
      out[j] = std::cos(zj) * inv;
    }
  }
  // dz_j = (-g_j sin z_j + g_{m+j} cos z_j) / √m, dx = D^-1/4 W dz
  template <class T>
  static void vjp(T const* x, std::size_t d, T const* w, std::size_t m, T const* g, T* dx) {
    std::vector<T> dz(m);
    param_vjp(x, d, w, m, g, dz.data());  // h = D^-1/4 dz
    for (std::size_t i = 0; i < d; ++i) {
      T acc = 0;
      for (std::size_t j = 0; j < m; ++j) acc += w[i * m + j] * dz[j];
      dx[i] = acc;
    }
  }
  template <class T>
  static void param_vjp(T const* x, std::size_t d, T const* w, std::size_t m, T const* g, T* h) {
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25)), inv = T(1) / std::sqrt(static_cast<T>(m));
    for (std::size_t j = 0; j < m; ++j) {
      T z = 0;
      for (std::size_t i = 0; i < d; ++i) z += w[i * m + j] * x[i];
      h[j] = s * inv * (-g[j] * std::sin(s * z) + g[m + j] * std::cos(s * z));
    }
  }
  // From the features (φ_j = cos(s z_j)/√m, φ_{m+j} = sin(s z_j)/√m):
  // h_j = s (-g_j φ_{m+j} + g_{m+j} φ_j), as param_vjp's; no part of dx outside z.
  template <class T>
  static void grad_z(std::size_t d, std::size_t m, T const* phi, T const* g, T* h) {
    T const s = static_cast<T>(std::pow(static_cast<double>(d), -0.25));
    detail::each_lane(h, m, [phi, g, s, m](std::size_t j) { return s * (g[m + j] * phi[j] - g[j] * phi[m + j]); });
  }
};

}  // namespace lina
