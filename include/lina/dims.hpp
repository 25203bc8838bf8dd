// Named dimensions with static or dynamic extents (CuTe-style: one interface,
// static arithmetic stays static), and the dimensions derived from them.
//
//   constexpr auto N = dim<"N">;       // extent known at run time
//   constexpr auto D = dim<"D", 64>;   // extent known at compile time
//
// A dimension is identified by its name; extents are looked up by name in an
// "extent source" (a bound tensor table at run time, a sampler in the cost model).
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>

#include "lina/detail/type_list.hpp"
#include "lina/fixed_string.hpp"

namespace lina {

inline constexpr std::size_t dynamic_extent = static_cast<std::size_t>(-1);

template <class Dim>
struct extent_binding {  // `N = 4096`, an extent handed to lina::estimate
  std::size_t extent;
};

template <fixed_string Name, std::size_t Extent = dynamic_extent>
struct dim_t {
  static constexpr auto name = Name;
  static constexpr bool is_static = Extent != dynamic_extent;
  static constexpr std::size_t static_extent = Extent;
  using bases = detail::type_list<dim_t>;

  template <class Source>
  static constexpr auto extent(Source const& s) {
    if constexpr (is_static)
      return static_cast<decltype(s.template get<dim_t>())>(Extent);
    else
      return s.template get<dim_t>();
  }
  static std::string label() { return std::string(Name.view()); }

  constexpr extent_binding<dim_t> operator=(std::size_t n) const { return {n}; }
};

template <fixed_string Name, std::size_t Extent = dynamic_extent>
inline constexpr dim_t<Name, Extent> dim{};

// C = Map::features(D): columns of phi<Map>(X) when X has D columns. Element-wise
// maps keep D itself (see feature_dim_t), so phi(Q)*transpose(K) type-checks.
template <class Map, class D>
struct feature_dim {
  static constexpr bool is_static = D::is_static;
  static constexpr std::size_t static_extent = is_static ? Map::features(D::static_extent) : dynamic_extent;
  using bases = typename D::bases;

  template <class Source>
  static constexpr auto extent(Source const& s) {
    using R = decltype(D::extent(s));
    return static_cast<R>(Map::features(static_cast<std::size_t>(D::extent(s))));
  }
  static std::string label() { return std::string(Map::name) + "(" + D::label() + ")"; }
};

// M+1: a matrix with a ones column appended, so one pass yields the numerator
// and the normaliser of normalize(S)*V.
template <class D>
struct plus_one {
  static constexpr bool is_static = D::is_static;
  static constexpr std::size_t static_extent = is_static ? D::static_extent + 1 : dynamic_extent;
  using bases = typename D::bases;

  template <class Source>
  static constexpr auto extent(Source const& s) {
    return D::extent(s) + 1;
  }
  static std::string label() { return D::label() + "+1"; }
};

// Matches every dimension; the shape of rewrite-pattern variables.
struct any_dim {
  static constexpr bool is_static = false;
  static constexpr std::size_t static_extent = dynamic_extent;
  using bases = detail::type_list<>;
  static std::string label() { return "_"; }
};

namespace detail {
template <class D>
struct minus_one_impl {
  using type = void;  // only the ones column lina appended itself is ever removed
};
template <class D>
struct minus_one_impl<plus_one<D>> {
  using type = D;
};
template <>
struct minus_one_impl<any_dim> {
  using type = any_dim;
};
template <class Map, class D, class = void>
struct feature_dim_impl {
  using type = feature_dim<Map, D>;
};
template <class Map, class D>
struct feature_dim_impl<Map, D, std::enable_if_t<requires { Map::value(0.0); }>> {
  using type = D;  // element-wise maps keep the dimension
};
template <class Map>
struct feature_dim_impl<Map, any_dim, void> {
  using type = any_dim;
};
}  // namespace detail

template <class D>
using minus_one_t = typename detail::minus_one_impl<D>::type;
template <class Map, class D>
using feature_dim_t = typename detail::feature_dim_impl<Map, D>::type;

template <class T>
inline constexpr bool is_dim_t = false;
template <fixed_string Name, std::size_t E>
inline constexpr bool is_dim_t<dim_t<Name, E>> = true;

namespace concepts {
// A dimension whose extent a binding's table holds, its own one base: one
// declared by the user, dim<"N"> or dim<"D", 64> (or a backend's of its own,
// as the CPU's blocks of query rows). Not D + 1 or a feature map's width,
// which follow from their bases.
template <class T>
concept base_dimension = requires { typename std::remove_cvref_t<T>::bases; } &&
                         std::is_same_v<typename std::remove_cvref_t<T>::bases,
                                        detail::type_list<std::remove_cvref_t<T>>>;
}  // namespace concepts

// Two dimensions are the same when they are the same type; pattern variables
// (any_dim) match everything.
template <class A, class B>
inline constexpr bool same_dim = std::is_same_v<A, B> || std::is_same_v<A, any_dim> || std::is_same_v<B, any_dim>;

// Same name, different static extents: declared twice inconsistently.
template <class A, class B>
inline constexpr bool conflicting_dims = false;
template <fixed_string N1, std::size_t E1, fixed_string N2, std::size_t E2>
inline constexpr bool conflicting_dims<dim_t<N1, E1>, dim_t<N2, E2>> = (N1 == N2) && E1 != E2;

// Shapes: a matrix (rows x cols) per batch and head, or a sequence of
// (a x b) matrices, one per row (the per-row outer products of a scan; these
// exist in plans only and are never materialised by a backend).
template <class R, class C>
struct matrix_shape {
  static constexpr int rank = 2;
  using rows = R;
  using cols = C;
};
// The shape of rewrite-pattern variables: whatever is asked of it matches.
struct any_shape {
  static constexpr int rank = 0;
  using rows = any_dim;
  using cols = any_dim;
  using a = any_dim;
  using b = any_dim;
};
template <class R, class A, class B>
struct row_seq_shape {
  static constexpr int rank = 3;
  using rows = R;
  using a = A;
  using b = B;
};

}  // namespace lina
