// Minimal type lists for structure queries over expression types. Hana works
// on values; these stay at the type level where only types are involved,
// which keeps instantiations (and compile times) small.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace lina::detail {

template <class... T>
struct type_list {
  static constexpr std::size_t size = sizeof...(T);
};

template <class List, class T>
struct contains;
template <class... U, class T>
struct contains<type_list<U...>, T> : std::bool_constant<(std::is_same_v<U, T> || ...)> {};

// Append T unless already present.
template <class List, class T>
struct add_unique;
template <class... U, class T>
struct add_unique<type_list<U...>, T> {
  using type = std::conditional_t<contains<type_list<U...>, T>::value, type_list<U...>, type_list<U..., T>>;
};

template <class A, class B>
struct merge_unique;
template <class A>
struct merge_unique<A, type_list<>> {
  using type = A;
};
template <class A, class T, class... R>
struct merge_unique<A, type_list<T, R...>> {
  using type = typename merge_unique<typename add_unique<A, T>::type, type_list<R...>>::type;
};

template <class... Lists>
struct concat_lists;
template <>
struct concat_lists<> {
  using type = type_list<>;
};
template <class... A>
struct concat_lists<type_list<A...>> {
  using type = type_list<A...>;
};
template <class... A, class... B, class... Rest>
struct concat_lists<type_list<A...>, type_list<B...>, Rest...> {
  using type = typename concat_lists<type_list<A..., B...>, Rest...>::type;
};

// Position of X in List (List::size when X is absent).
template <class X, class List>
struct index_of;
template <class X, class... T>
struct index_of<X, type_list<T...>> {
  static constexpr std::size_t value = [] {
    constexpr bool same[] = {std::is_same_v<X, T>..., true};
    std::size_t i = 0;
    while (!same[i]) ++i;
    return i;
  }();
};
template <class X, class List>
inline constexpr std::size_t index_of_v = index_of<X, List>::value;

template <class List>
struct front;
template <class T, class... R>
struct front<type_list<T, R...>> {
  using type = T;
};
template <class List>
using front_t = typename front<List>::type;

// The I-th type of List: one overload resolution against a class that
// derives from (index, type) for each element, instantiated once per list,
// rather than a recursion that instantiates every suffix of the list (the
// schedule of a deep stack's gradient asks for each of ~150 steps).
template <std::size_t I, class T>
struct indexed {
  using type = T;
};
template <class Indices, class... T>
struct indexer;
template <std::size_t... I, class... T>
struct indexer<std::index_sequence<I...>, T...> : indexed<I, T>... {};
template <std::size_t I, class T>
indexed<I, T> select_indexed(indexed<I, T> const*);
template <std::size_t I, class List>
struct type_at;
template <std::size_t I, class... T>
struct type_at<I, type_list<T...>> {
  static_assert(I < sizeof...(T), "lina: type_at past the end of a type list");
  using type = typename decltype(select_indexed<I>(
      static_cast<indexer<std::index_sequence_for<T...>, T...> const*>(nullptr)))::type;
};
template <std::size_t I, class List>
using type_at_t = typename type_at<I, List>::type;

template <class T>
inline constexpr bool always_false = false;

}  // namespace lina::detail
