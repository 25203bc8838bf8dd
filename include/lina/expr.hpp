// What users write: inputs, feature maps, transpose, products, the causal
// mask, row normalisation, scaling and exp. Each function checks its operands
// with one static_assert that says what to fix (the dimensions involved show
// in the diagnose:: instantiation the compiler prints above the message), then
// builds a node. Nothing here evaluates anything.
#pragma once

#include <cmath>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/dims.hpp"
#include "lina/feature_maps.hpp"
#include "lina/node.hpp"

namespace lina {

namespace diagnose {
// These exist to put the offending dimensions into the compiler's output.
template <class LeftCols, class RightRows>
struct product_inner_dimensions {
  static_assert(!conflicting_dims<LeftCols, RightRows>,
                "lina: A * B: this dimension name is declared with two different static extents; "
                "declare each dim<\"name\", extent> once and reuse it");
  static_assert(conflicting_dims<LeftCols, RightRows> || same_dim<LeftCols, RightRows>,
                "lina: A * B needs the columns of A to be the same dimension as the rows of B; "
                "transpose one operand or declare both with the same dim");
  static constexpr bool ok = same_dim<LeftCols, RightRows>;
};
template <class Rows, class Cols>
struct causal_needs_square {
  static_assert(same_dim<Rows, Cols>,
                "lina: causal(S) masks a square similarity: S must be N x N (rows and columns the same "
                "dimension), e.g. causal(phi<m>(Q) * transpose(phi<m>(K)))");
  static constexpr bool ok = same_dim<Rows, Cols>;
};
template <class Map>
struct feature_map_concept {
  static_assert(concepts::feature_map<Map>,
                "lina: phi<Map>: Map is not a feature map; declare name and value(x)/derivative(x) "
                "(element-wise) or features(d)/apply/vjp (row map), see docs/dsl.md");
  static constexpr bool ok = concepts::feature_map<Map>;
};
template <class R, class C>
struct input_dimensions {
  static_assert(concepts::base_dimension<R> && concepts::base_dimension<C>,
                "lina: input<\"name\">(rows, cols): both extents must be dimensions made with "
                "lina::dim<\"name\"> or lina::dim<\"name\", extent>");
  static constexpr bool ok = concepts::base_dimension<R> && concepts::base_dimension<C>;
};

template <class Map, bool WithParameter>
struct feature_map_arguments {
  static_assert(!concepts::parametric_map<Map> || WithParameter,
                "lina: phi<Map>(X): this map is parametric (random features); pass its projection as "
                "phi<Map>(X, W) with W an input of shape (D x m), e.g. drawn by gaussian_projection");
  static_assert(concepts::parametric_map<Map> || !WithParameter,
                "lina: phi<Map>(X, W): this map takes no parameter; write phi<Map>(X)");
  static constexpr bool ok = concepts::parametric_map<Map> == WithParameter;
};
template <class XCols, class WRows>
struct projection_rows {
  static_assert(same_dim<XCols, WRows>,
                "lina: phi<Map>(X, W): W's rows must be the same dimension as X's columns (W is D x m)");
  static constexpr bool ok = same_dim<XCols, WRows>;
};
}  // namespace diagnose

// input<"Q">(N, D): a named (N x D) matrix per batch and head.
template <fixed_string Name, class R, class C>
constexpr auto input(R, C) {
  static_assert(diagnose::input_dimensions<R, C>::ok || true);
  return node<op::input<Name, R, C>>{};
}


template <class Map>
struct phi_fn {
  template <class X>
    requires is_node<X>
  constexpr auto operator()(X const& x) const {
    static_assert((diagnose::feature_map_concept<Map>::ok && diagnose::feature_map_arguments<Map, false>::ok) ||
                  true);
    return make_node(op::phi<Map>{}, x);
  }
  template <class X, class W>
    requires(is_node<X> && is_node<W>)
  constexpr auto operator()(X const& x, W const& w) const {
    static_assert((diagnose::feature_map_concept<Map>::ok && diagnose::feature_map_arguments<Map, true>::ok &&
                   diagnose::projection_rows<typename X::shape::cols, typename W::shape::rows>::ok) ||
                  true);
    return make_node(op::phi<Map>{}, x, w);
  }
};
// phi<Map>(X), or phi<Map>(X, W) for a parametric map: the feature map applied to each row of X.
template <class Map>
inline constexpr phi_fn<Map> phi{};

template <class X>
  requires is_node<X>
constexpr auto transpose(X const& x) {
  return make_node(op::transpose{}, x);
}

template <class A, class B>
  requires(is_node<A> && is_node<B>)
constexpr auto operator*(A const& a, B const& b) {
  static_assert(
      diagnose::product_inner_dimensions<typename A::shape::cols, typename B::shape::rows>::ok || true);
  return make_node(op::product{}, a, b);
}

// The decay of a causal mask: token j's weight in row i is gamma^(i-j), so
// the running state forgets geometrically (RetNet's retention; gamma = 1 is
// the plain mask). gamma outside [0, 1] (or NaN) is refused: above 1 the
// state grows without bound. In a constant expression the refusal is a
// compile error at the throw.
struct decay {
  double gamma;
  constexpr explicit decay(double g) : gamma(g) {
    if (!(g >= 0 && g <= 1))
      throw std::invalid_argument("lina::decay: gamma must be in [0, 1] (1 is no decay), got " + std::to_string(g));
  }
};

// A decay per head: head h weighs token j in row i by gammas[h]^(i-j)
// (RetNet's retention, whose heads forget at different rates; ALiBi's bias,
// one slope per head). Each gamma in [0, 1], at least one; a backend refuses
// a list whose length is not the bound number of heads (lina::shape_error).
struct head_decays {
  std::vector<double> gammas;
  explicit head_decays(std::vector<double> g) : gammas(std::move(g)) {
    if (gammas.empty()) throw std::invalid_argument("lina::head_decays: no decay given (one per head)");
    for (std::size_t h = 0; h < gammas.size(); ++h)
      if (!(gammas[h] >= 0 && gammas[h] <= 1))
        throw std::invalid_argument("lina::head_decays: gamma of head " + std::to_string(h) +
                                    " must be in [0, 1] (1 is no decay), got " + std::to_string(gammas[h]));
  }
  // RetNet's: gamma_h = 1 - 2^(-5-h).
  static head_decays retnet(std::size_t heads) {
    std::vector<double> g(heads);
    for (std::size_t h = 0; h < heads; ++h) g[h] = 1 - std::ldexp(1.0, -5 - static_cast<int>(h));
    return head_decays(std::move(g));
  }
  // ALiBi's bias -m_h (i-j) inside exp as a decay e^(-m_h): slopes
  // m_h = 2^(-8(h+1)/n) for n = heads a power of two; otherwise those of the
  // largest power of two n below, then every other slope of 2n (the ALiBi
  // paper's recipe).
  static head_decays alibi(std::size_t heads) {
    auto slopes = [](std::size_t n) {
      std::vector<double> m(n);
      for (std::size_t h = 0; h < n; ++h) m[h] = std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(n));
      return m;
    };
    std::size_t n = 1;
    while (2 * n <= heads) n *= 2;
    std::vector<double> m = slopes(heads == 0 ? 0 : n);
    std::vector<double> const twice = slopes(2 * n);
    for (std::size_t k = 0; m.size() < heads; k += 2) m.push_back(twice[k]);
    for (double& x : m) x = std::exp(-x);
    return head_decays(std::move(m));
  }
};

// causal(S): keep S_ij for j <= i, zero elsewhere; causal(S, decay{g}):
// keep g^(i-j) S_ij; causal(S, head_decays{…}): head h's g. Each becomes a
// prefix scan in linear order.
template <class X>
  requires is_node<X>
constexpr auto causal(X const& x) {
  static_assert(diagnose::causal_needs_square<typename X::shape::rows, typename X::shape::cols>::ok || true);
  return make_node(op::causal{}, x);
}
template <class X>
  requires is_node<X>
constexpr auto causal(X const& x, decay d) {
  static_assert(diagnose::causal_needs_square<typename X::shape::rows, typename X::shape::cols>::ok || true);
  return make_node(op::causal_t<op::decay_by>{{d.gamma}}, x);
}
template <class X>
  requires is_node<X>
auto causal(X const& x, head_decays d) {
  static_assert(diagnose::causal_needs_square<typename X::shape::rows, typename X::shape::cols>::ok || true);
  return make_node(op::causal_t<op::decay_per_head>{{std::make_shared<std::vector<double> const>(std::move(d.gammas))}}, x);
}

// normalize(S): each row divided by its sum plus eps, so that
// normalize(S) * V = diag(S 1 + eps)^-1 S V. eps keeps an all-zero row
// (possible with relu) finite; it is 1e-6 by default, as in fast-transformers.
template <class X>
  requires is_node<X>
constexpr auto normalize(X const& x, double eps = 1e-6) {
  return make_node(op::normalize{eps}, x);
}

// exp(S), element-wise: the softmax similarity. It never linearises.
template <class X>
  requires is_node<X>
constexpr auto exp(X const& x) {
  return make_node(op::exp{}, x);
}

template <class X>
  requires is_node<X>
constexpr auto operator*(double s, X const& x) {
  return make_node(op::scale{s}, x);
}
template <class X>
  requires is_node<X>
constexpr auto operator*(X const& x, double s) {
  return make_node(op::scale{s}, x);
}
template <class X>
  requires is_node<X>
constexpr auto operator/(X const& x, double s) {
  return make_node(op::scale{1.0 / s}, x);
}

}  // namespace lina
