// What users write: inputs, feature maps, transpose, products, the causal
// mask, row normalisation, scaling and exp. Each function checks its operands
// with one static_assert that says what to fix (the dimensions involved show
// in the diagnose:: instantiation the compiler prints above the message), then
// builds a node. Nothing here evaluates anything.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

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

// causal(S): keep S_ij for j <= i, zero elsewhere; causal(S, decay{g}):
// keep g^(i-j) S_ij. Either becomes a prefix scan in linear order.
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
