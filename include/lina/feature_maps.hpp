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
// NaN inputs must give NaN outputs: compare so that NaN falls through.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <string_view>

namespace lina {

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
concept feature_map = elementwise_map<M> || row_map<M>;

}  // namespace concepts

// elu(x) + 1: the paper's map; positive, so normalisers stay positive.
struct elu_plus_one {
  static constexpr std::string_view name = "elu+1";
  template <class T>
  static constexpr T value(T x) {
    return x > T(0) ? x + T(1) : std::exp(x);
  }
  template <class T>
  static constexpr T derivative(T x) {
    return x > T(0) ? T(1) : std::exp(x);
  }
};

// max(x, 0); non-negative, can be all zero (then the normaliser is eps alone).
struct relu {
  static constexpr std::string_view name = "relu";
  template <class T>
  static constexpr T value(T x) {
    return x < T(0) ? T(0) : x;  // NaN passes through
  }
  template <class T>
  static constexpr T derivative(T x) {
    return x < T(0) ? T(0) : (x > T(0) ? T(1) : (x == T(0) ? T(0) : x));
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

}  // namespace lina
