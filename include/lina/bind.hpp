// Checking what is bound to a plan's inputs, for every backend: statically
// (every input bound exactly once, no stray symbol, one element type, one kind
// of view) and at run time (batch, heads and every named dimension agree
// across inputs and with static extents; a disagreement throws
// lina::shape_error naming the symbol, the dimension and both extents). The
// result, bound_inputs, is what a backend evaluates from: one view per input
// and the extent table that resolves selects and sizes results.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "lina/dims.hpp"
#include "lina/errors.hpp"
#include "lina/node.hpp"
#include "lina/tensor.hpp"

namespace lina {

namespace diagnose {
template <fixed_string Input, std::size_t TimesBound>
struct input_binding {
  static_assert(TimesBound != 0,
                "lina: an input of the plan is not bound: pass it as Name = tensor (the input's name is in "
                "the instantiation of input_binding above)");
  static_assert(TimesBound <= 1,
                "lina: an input is bound twice: pass each input once (its name is in the instantiation of "
                "input_binding above)");
  static constexpr bool ok = TimesBound == 1;
};
template <fixed_string Symbol, bool IsInput>
struct binding_symbol {
  static_assert(IsInput,
                "lina: a bound symbol is not an input of the plan (its name is in the instantiation of "
                "binding_symbol above); bind only the inputs the expression uses");
  static constexpr bool ok = IsInput;
};
template <bool Same>
struct binding_element_types {
  static_assert(Same, "lina: all bound tensors must have the same element type (all float or all double)");
  static constexpr bool ok = Same;
};
template <bool Same>
struct binding_view_types {
  static_assert(Same,
                "lina: all bound tensors must live in the same kind of memory (all host tensors, or all of one "
                "backend's device tensors)");
  static constexpr bool ok = Same;
};
}  // namespace diagnose

// Extents of the named dimensions of one evaluation, looked up by type.
template <class Dims>
struct extent_table;
template <class... D>
struct extent_table<lina::detail::type_list<D...>> {
  using dims = lina::detail::type_list<D...>;
  static constexpr std::size_t size = sizeof...(D);
  std::array<std::size_t, size> value{};
  std::array<std::string, size> bound_by{};  // the input that set a dynamic extent

  template <class X>
  static constexpr std::size_t index_of() {
    return lina::detail::index_of_v<X, lina::detail::type_list<D...>>;
  }
  template <class X>
  std::size_t get() const {
    static_assert(index_of<X>() < size, "lina: a dimension of the plan is not a dimension of its inputs");
    return value[index_of<X>()];
  }
};

// The checked bindings of one evaluation: one view per input of the plan (in
// the order of inputs_of<Plan>), batch and heads, and the extent table.
// Keyed on the input and dimension lists, not on the plan: this type is part
// of every lowering's instantiation, so it is kept short.
template <class Inputs, class Dims, class View>
struct bound_inputs {
  using view_type = View;
  using value_type = std::remove_const_t<typename View::element_type_>;
  using inputs = Inputs;
  using table_type = extent_table<Dims>;
  std::array<View, inputs::size> views;
  std::size_t batch = 0, heads = 0;
  table_type table;

  // Position of input op In in `views`.
  template <class In>
  static constexpr std::size_t input_index() {
    return lina::detail::index_of_v<In, inputs>;
  }
};

namespace detail {

template <fixed_string Name, class... B>
constexpr std::size_t times_bound() {
  return ((B::name == Name ? 1u : 0u) + ... + 0u);
}
template <fixed_string Name, class... B>
constexpr std::size_t binding_position() {
  constexpr std::array<bool, sizeof...(B) + 1> m{(B::name == Name)..., true};
  std::size_t i = 0;
  while (!m[i]) ++i;
  return i;
}
template <fixed_string S, class Inputs>
struct names_an_input;
template <fixed_string S, class... I>
struct names_an_input<S, lina::detail::type_list<I...>> : std::bool_constant<((I::name == S) || ...)> {};

// How an input's rows or columns are checked, as data, so that the checks
// themselves (bind_views) are one function per kind of bindings rather than
// lambdas per input of every plan (bind<> was ~500 functions of a test file
// of gradients, 2026-12-06). A base dimension's extent is set by the first
// input that has it (or by its static extent) and checked against every
// later one; a derived one (M+1: a value the forward saved,
// save_for_backward) is checked once the bases are known.
template <class Table>
struct extent_rule {
  std::string (*label)() = nullptr;
  std::size_t (*derived)(Table const&) = nullptr;  // a derived one's extent; null for a named dimension (dim_t)
  std::size_t index = 0;                           // a named one's place in the table
  bool fixed = false;                              // a named one declared static
  std::size_t fixed_extent = 0;
};
template <class Table, class Dim>
std::size_t derived_extent(Table const& t) {
  return static_cast<std::size_t>(Dim::extent(t));
}
template <class Table, class Dim>
constexpr extent_rule<Table> extent_rule_of() {
  if constexpr (is_dim_t<Dim>)
    return {&Dim::label, nullptr, Table::template index_of<Dim>(), Dim::is_static, Dim::static_extent};
  else
    return {&Dim::label, &derived_extent<Table, Dim>};
}

template <class Table>
void check_extent(Table& t, extent_rule<Table> const& d, std::size_t got, std::string const& symbol) {
  if (d.derived) return;  // checked once the named ones are known
  std::size_t const k = d.index;
  if (d.fixed) {
    if (got != d.fixed_extent)
      throw shape_error(symbol, d.label(), got, d.fixed_extent,
                        "declared static by dim<\"" + d.label() + "\", " + std::to_string(d.fixed_extent) + ">");
    t.value[k] = got;
  } else if (t.bound_by[k].empty()) {
    t.value[k] = got;
    t.bound_by[k] = symbol;
  } else if (t.value[k] != got) {
    throw shape_error(symbol, d.label(), got, t.value[k], "bound by input " + t.bound_by[k]);
  }
}

template <class Table>
void check_derived_extent(Table const& t, extent_rule<Table> const& d, std::size_t got, std::string_view symbol) {
  if (!d.derived) return;
  std::size_t const want = d.derived(t);
  if (got != want) throw shape_error(std::string(symbol), d.label(), got, want, "of the plan's inputs");
}

// A binding's view, where it is of the evaluation's kind (else diagnosed in bind).
template <class View, class Binding>
View const* view_of(Binding const& b) {
  if constexpr (std::is_same_v<decltype(b.view), View>)
    return &b.view;
  else
    return nullptr;
}

// The run-time checks of bind, input by input (given[k]: input k's view,
// null where it is not bound, which bind diagnoses at compile time).
template <class Bound, std::size_t Inputs>
void bind_views(Bound& r, std::array<typename Bound::view_type const*, Inputs> const& given,
                std::array<std::string_view, Inputs> const& names,
                std::array<std::array<extent_rule<typename Bound::table_type>, 2>, Inputs> const& rules) {
  bool first = true;
  std::string first_symbol;
  for (std::size_t k = 0; k < Inputs; ++k) {
    if (!given[k]) continue;
    auto const& v = *given[k];
    std::string symbol(names[k]);
    if (first) {
      r.batch = v.shape()[0];
      r.heads = v.shape()[1];
      first_symbol = symbol;
      first = false;
    } else {
      if (v.shape()[0] != r.batch) throw shape_error(symbol, "B (batch)", v.shape()[0], r.batch, "of input " + first_symbol);
      if (v.shape()[1] != r.heads) throw shape_error(symbol, "H (heads)", v.shape()[1], r.heads, "of input " + first_symbol);
    }
    check_extent(r.table, rules[k][0], v.shape()[2], symbol);
    check_extent(r.table, rules[k][1], v.shape()[3], symbol);
    r.views[k] = v;
  }
  for (std::size_t k = 0; k < Inputs; ++k) {
    check_derived_extent(r.table, rules[k][0], r.views[k].shape()[2], names[k]);
    check_derived_extent(r.table, rules[k][1], r.views[k].shape()[3], names[k]);
  }
}

}  // namespace detail

// Check the bindings against the plan; the element type is that of the bindings.
template <class Plan, class... B>
auto bind(B const&... bs) {
  using inputs = inputs_of<Plan>;
  static_assert(sizeof...(B) > 0, "lina: evaluate needs the plan's inputs bound, e.g. Q = q, K = k, V = v");
  using first_binding = std::tuple_element_t<0, std::tuple<B...>>;
  using T = typename first_binding::value_type;
  using View = typename first_binding::view_type;
  static_assert(diagnose::binding_element_types<(std::is_same_v<T, typename B::value_type> && ...)>::ok || true);
  static_assert(diagnose::binding_view_types<!(std::is_same_v<T, typename B::value_type> && ...) ||
                                             (std::is_same_v<View, typename B::view_type> && ...)>::ok ||
                true);  // one error at a time: the element types first
  static_assert((diagnose::binding_symbol<B::name, detail::names_an_input<B::name, inputs>::value>::ok && ...) || true);

  using bound_type = bound_inputs<inputs, dims_of<Plan>, View>;
  using table_type = typename bound_type::table_type;
  bound_type r;
  std::array<View const*, sizeof...(B)> const all{detail::view_of<View>(bs)...};
  [&]<class... I>(lina::detail::type_list<I...>) {
    static_assert((diagnose::input_binding<I::name, detail::times_bound<I::name, B...>()>::ok && ...) || true);
    constexpr std::array<std::size_t, sizeof...(I)> position{detail::binding_position<I::name, B...>()...};
    static constexpr std::array<std::string_view, sizeof...(I)> names{I::name.view()...};
    static constexpr std::array<std::array<detail::extent_rule<table_type>, 2>, sizeof...(I)> rules{
        {{detail::extent_rule_of<table_type, typename I::rows>(), detail::extent_rule_of<table_type, typename I::cols>()}...}};
    std::array<View const*, sizeof...(I)> given{};
    for (std::size_t k = 0; k < sizeof...(I); ++k) given[k] = position[k] < sizeof...(B) ? all[position[k]] : nullptr;
    detail::bind_views(r, given, names, rules);
  }(inputs{});
  return r;
}

// Whether a tree holds a decay per head (an op with `decays`): most plans hold
// none, and the walk below then instantiates nothing.
template <class N>
inline constexpr bool has_head_decays = false;
template <class Op, class... K>
inline constexpr bool has_head_decays<node<Op, K...>> =
    requires(Op const& o) { o.decays; } || (has_head_decays<K> || ...);

// f(the op) for every decay per head in a plan (causal(S, head_decays{…})).
template <class X, class F>
void for_each_head_decays(X const&, F&&) {}
template <class Op, class... K, class F>
void for_each_head_decays(node<Op, K...> const& n, F&& f) {
  if constexpr (has_head_decays<node<Op, K...>>) {
    if constexpr (requires { n.op.decays; }) f(n.op);
    for_each_kid(n, [&](auto const& k) { for_each_head_decays(k, f); });
  }
}
// Each against the bound number of heads: one decay per head, else
// lina::shape_error "decay per head" before anything runs.
template <class P>
void check_head_decays(P const& plan, std::size_t heads) {
  for_each_head_decays(plan, [&](auto const& d) {
    if (d.heads() != heads)
      throw shape_error("decay per head", "H (heads)", d.heads(), heads, "of the bound inputs (head_decays: one per head)");
  });
}
// The heads a plan's decays per head are for (the first's), 0 where it has none.
template <class P>
std::size_t heads_of_decays(P const& plan) {
  std::size_t h = 0;
  for_each_head_decays(plan, [&](auto const& d) { h = h ? h : d.heads(); });
  return h;
}

// The shape [B, H, rows, cols] of plan P's result for these bindings.
template <class P, class Bound>
shape4 result_shape(Bound const& in) {
  using S = typename P::shape;
  return {in.batch, in.heads, static_cast<std::size_t>(S::rows::extent(in.table)),
          static_cast<std::size_t>(S::cols::extent(in.table))};
}

// A caller's output must have the shape of P's result (else shape_error "out").
template <class P, class Bound>
void check_result_shape(shape4 const& got, Bound const& in) {
  shape4 want = result_shape<P>(in);
  static constexpr char const* names[] = {"B (batch)", "H (heads)", "rows", "cols"};
  for (int d = 0; d < 4; ++d)
    if (got[d] != want[d]) throw shape_error("out", names[d], got[d], want[d], "of the plan's result");
}

}  // namespace lina
