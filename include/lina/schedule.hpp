// The schedule of a plan: what every backend walks.
//
// A plan is a tree; a backend wants a flat program. schedule_of<Plan> is that
// program, computed at compile time from the plan's type:
//
//   - steps in evaluation order (kids before parents), one per node that
//     computes something. Inputs and views (transpose, dropcol) are not steps:
//     they are operands, read in place;
//   - fused groups: contract(A, prefix(B⊗C)) and its suffix form are one step
//     with operands A, B, C (per-row sequences are never materialised); a
//     chain of row-wise steps is one pass over rows, made as a scan loads it
//     when a scan is its only reader, or fed by a scan's finished rows when
//     it is the scan's only reader (absorbed_by, emits, runs_in);
//   - common subexpressions: a subtree that occurs twice is one step when its
//     type proves the two equal (no op in it carries a value); same-typed
//     subtrees with values (an eps, a scale factor) get their own steps, each
//     naming its earlier `twin`, and the backend shares them when
//     same_value() says so at run time;
//   - scan indices: each prefix-scan step knows its place in the plan's state
//     (the scan's running sums), fixed here, from the type;
//   - last uses: after step j, the results no later step or output reads can be
//     released;
//   - outputs: the operands that are the plan's results (a bundle of gradients
//     has several).
//
// Run-time choices (select) never reach a schedule: resolve_selects() picks
// the branch of every select once per call, on the host, and hands the
// select-free plan on (with_resolved_plan).
#pragma once

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "lina/node.hpp"

namespace lina {

namespace sched {

using detail::concat_lists;
using detail::type_list;

// ---- paths: where a node sits in the plan ---------------------------------------
template <class Path, std::size_t... J>
struct extend;
template <std::size_t... I, std::size_t... J>
struct extend<std::index_sequence<I...>, J...> {
  using type = std::index_sequence<I..., J...>;
};
template <class Path, std::size_t... J>
using extend_t = typename extend<Path, J...>::type;

template <class N>
constexpr auto const& at_path(N const& n, std::index_sequence<>) {
  return n;
}
template <class N, std::size_t I, std::size_t... R>
constexpr auto const& at_path(N const& n, std::index_sequence<I, R...>) {
  return at_path(kid<I>(n), std::index_sequence<R...>{});
}

// ---- what a node is to a schedule --------------------------------------------------
enum class role { input, view, scan, compute, bundle, select };

namespace diagnose {
template <bool Fused>
struct scan_group {
  static_assert(Fused,
                "lina: a per-row sequence (⊗, prefix, suffix) is evaluated only as contract(A, prefix(B⊗C)) or "
                "contract(A, suffix(B⊗C)); this plan uses one elsewhere");
  static constexpr bool ok = Fused;
};
}  // namespace diagnose

template <class N>
constexpr role role_of() {
  using Op = typename N::op_type;
  if constexpr (is_input_op_v<Op>)
    return role::input;
  else if constexpr (std::is_same_v<Op, op::transpose> || std::is_same_v<Op, op::drop_last>)
    return role::view;
  else if constexpr (std::is_same_v<Op, op::contract_rows>)
    return diagnose::scan_group<fused_scan_parts<N>::fused>::ok ? role::scan : role::compute;
  else if constexpr (std::is_same_v<Op, op::bundle>)
    return role::bundle;
  else if constexpr (is_select_op<Op>)
    return role::select;
  else
    return role::compute;
}

// Ops that map each row of their one operand to a row of the result, alone:
// a chain of them runs as one pass over rows (a fused group).
template <class N>
constexpr bool row_wise() {
  using Op = typename N::op_type;
  if constexpr (N::arity != 1)
    return false;  // (a parametric φ also reads its projection)
  else
    return requires { typename Op::map; } || std::is_same_v<Op, op::scale> || std::is_same_v<Op, op::exp> ||
           is_causal_op<Op> || std::is_same_v<Op, op::normalize> ||
           std::is_same_v<Op, op::append_ones> || std::is_same_v<Op, op::row_divide>;
}

// Ops whose row i reads row i of each of their two operands and nothing else
// (the backward's adjoints): not part of chains, but a scan may hand its
// finished rows to one of them.
template <class N>
constexpr bool row_local_pair() {
  using Op = typename N::op_type;
  if constexpr (N::arity != 2)
    return false;  // (a parametric φ′ also reads its projection)
  else
    return requires { typename Op::vjp_of; } || std::is_same_v<Op, op::hadamard> || std::is_same_v<Op, op::add> ||
           std::is_same_v<Op, op::normalize_vjp> || std::is_same_v<Op, op::row_divide_vjp>;
}

// ---- occurrences: (path, node) of every computing node, kids first ------------
template <class Path, class N>
struct occurrence {
  using path = Path;
  using node_type = N;
};

template <class N, class Path>
struct occurrences;

template <class N, class Path, class Kids>
struct kid_occurrences;
template <class N, class Path, std::size_t... I>
struct kid_occurrences<N, Path, std::index_sequence<I...>> {
  using type = typename concat_lists<
      typename occurrences<std::remove_cvref_t<decltype(kid<I>(std::declval<N>()))>, extend_t<Path, I>>::type...>::type;
};

template <class N, class Path>
struct occurrences {
  static constexpr role r = role_of<N>();
  static_assert(r != role::select,
                "lina: a plan reaches a schedule only with its selects resolved (with_resolved_plan)");
  template <class K, std::size_t... I>
  using at = occurrences<K, extend_t<Path, I...>>;
  static auto pick() {
    if constexpr (r == role::input) {
      return type_list<>{};
    } else if constexpr (r == role::view) {
      return typename kid_occurrences<N, Path, std::make_index_sequence<N::arity>>::type{};
    } else if constexpr (r == role::scan) {
      using A = std::remove_cvref_t<decltype(kid<0>(std::declval<N>()))>;
      using outer = std::remove_cvref_t<decltype(kid<0>(kid<1>(std::declval<N>())))>;
      using B = std::remove_cvref_t<decltype(kid<0>(std::declval<outer>()))>;
      using C = std::remove_cvref_t<decltype(kid<1>(std::declval<outer>()))>;
      return typename concat_lists<typename at<A, 0>::type, typename at<B, 1, 0, 0>::type,
                                   typename at<C, 1, 0, 1>::type, type_list<occurrence<Path, N>>>::type{};
    } else if constexpr (r == role::bundle) {  // its outputs; kid 0 only binds inputs
      return []<std::size_t... I>(std::index_sequence<I...>) {
        return typename concat_lists<typename at<std::remove_cvref_t<decltype(kid<I + 1>(std::declval<N>()))>,
                                                 I + 1>::type...>::type{};
      }(std::make_index_sequence<N::arity - 1>{});
    } else {
      return typename concat_lists<typename kid_occurrences<N, Path, std::make_index_sequence<N::arity>>::type,
                                   type_list<occurrence<Path, N>>>::type{};
    }
  }
  using type = decltype(pick());
};

inline constexpr std::size_t none = static_cast<std::size_t>(-1);

// Drop an occurrence whose node type is value-free and already scheduled (an
// earlier occurrence has its type). Which occurrences stay is one constexpr
// table, and they are picked by index (type_at), not by a recursion over the
// occurrences that carried both lists through each of them (a three-layer
// gradient has ~320: the largest cost of Clang's front end for it).
template <class X, class Nodes>
constexpr std::size_t first_of_type() {  // where X first occurs, if it is value-free
  if constexpr (value_free<X>())
    return detail::index_of_v<X, Nodes>;
  else
    return none;
}
template <class Occurrences>
struct dedupe;
template <class... O>
struct dedupe<type_list<O...>> {
  struct kept {
    std::array<std::size_t, sizeof...(O) + 1> at{};
    std::size_t size = 0;
  };
  static constexpr kept keep = [] {
    using nodes = type_list<typename O::node_type...>;
    // (an initializer list, not a fold: Clang nests a fold's terms, and a
    // three-layer stack's backward has ~320 occurrences, past its limit of 256)
    constexpr std::array<std::size_t, sizeof...(O) + 1> first{first_of_type<typename O::node_type, nodes>()..., none};
    kept k;
    for (std::size_t i = 0; i < sizeof...(O); ++i)
      if (!(first[i] < i)) k.at[k.size++] = i;
    return k;
  }();
  template <std::size_t... K>
  static type_list<detail::type_at_t<keep.at[K], type_list<O...>>...> pick(std::index_sequence<K...>);
  using type = decltype(pick(std::make_index_sequence<keep.size>{}));
};

// ---- operands: where a step reads a kid ------------------------------------------
template <class In>
struct input_operand {  // a bound input (In: its op type)
  using input = In;
};
template <std::size_t Step>
struct step_operand {  // the result of an earlier step
  static constexpr std::size_t step = Step;
};
template <class Of>
struct transposed_operand {
  using of = Of;
};
template <class Of>
struct without_last_operand {  // dropcol: all but the last column
  using of = Of;
};

template <class Steps, class Path, class K>
constexpr std::size_t step_index() {
  return []<class... S>(type_list<S...>) {
    constexpr std::array<bool, sizeof...(S) + 1> hit{
        (std::is_same_v<typename S::node_type, K> && (value_free<K>() || std::is_same_v<typename S::path, Path>))...,
        true};
    std::size_t i = 0;
    while (!hit[i]) ++i;
    return i;
  }(Steps{});
}

template <class Steps, class K, class Path>
struct operand_of {
  static auto pick() {
    using Op = typename K::op_type;
    if constexpr (is_input_op_v<Op>)
      return input_operand<Op>{};
    else if constexpr (std::is_same_v<Op, op::transpose>)
      return transposed_operand<typename operand_of<Steps, std::remove_cvref_t<decltype(kid<0>(std::declval<K>()))>,
                                                    extend_t<Path, 0>>::type>{};
    else if constexpr (std::is_same_v<Op, op::drop_last>)
      return without_last_operand<typename operand_of<Steps, std::remove_cvref_t<decltype(kid<0>(std::declval<K>()))>,
                                                      extend_t<Path, 0>>::type>{};
    else
      return step_operand<step_index<Steps, Path, K>()>{};
  }
  using type = decltype(pick());
};

// The steps an operand reads (through views).
template <class O>
struct reads {
  static constexpr std::size_t step = none;
};
template <std::size_t S>
struct reads<step_operand<S>> {
  static constexpr std::size_t step = S;
};
template <class Of>
struct reads<transposed_operand<Of>> : reads<Of> {};
template <class Of>
struct reads<without_last_operand<Of>> : reads<Of> {};

// The operands of one step: its kids, or A, B, C of a fused scan.
template <class Steps, class O>
struct step_operands {
  using N = typename O::node_type;
  using P = typename O::path;
  static auto pick() {
    if constexpr (role_of<N>() == role::scan) {
      using A = std::remove_cvref_t<decltype(kid<0>(std::declval<N>()))>;
      using outer = std::remove_cvref_t<decltype(kid<0>(kid<1>(std::declval<N>())))>;
      using B = std::remove_cvref_t<decltype(kid<0>(std::declval<outer>()))>;
      using C = std::remove_cvref_t<decltype(kid<1>(std::declval<outer>()))>;
      return type_list<typename operand_of<Steps, A, extend_t<P, 0>>::type,
                       typename operand_of<Steps, B, extend_t<P, 1, 0, 0>>::type,
                       typename operand_of<Steps, C, extend_t<P, 1, 0, 1>>::type>{};
    } else {
      return []<std::size_t... I>(std::index_sequence<I...>) {
        return type_list<typename operand_of<Steps, std::remove_cvref_t<decltype(kid<I>(std::declval<N>()))>,
                                             extend_t<P, I>>::type...>{};
      }(std::make_index_sequence<N::arity>{});
    }
  }
  using type = decltype(pick());
};

template <class Steps, class Root>
struct outputs_of {
  static auto pick() {
    if constexpr (role_of<Root>() == role::bundle)
      return []<std::size_t... I>(std::index_sequence<I...>) {
        return type_list<typename operand_of<Steps, std::remove_cvref_t<decltype(kid<I + 1>(std::declval<Root>()))>,
                                             std::index_sequence<I + 1>>::type...>{};
      }(std::make_index_sequence<Root::arity - 1>{});
    else
      return type_list<typename operand_of<Steps, Root, std::index_sequence<>>::type>{};
  }
  using type = decltype(pick());
};

}  // namespace sched

// The schedule of a select-free plan (see the top of this file).
template <class Plan>
struct schedule_of {
  using steps = typename sched::dedupe<typename sched::occurrences<Plan, std::index_sequence<>>::type>::type;
  static constexpr std::size_t size = steps::size;

  template <std::size_t J>
  using step = detail::type_at_t<J, steps>;
  template <std::size_t J>
  using node_type = typename step<J>::node_type;
  template <std::size_t J>
  using operands = typename sched::step_operands<steps, step<J>>::type;
  using outputs = typename sched::outputs_of<steps, Plan>::type;

  template <std::size_t J>
  static constexpr bool is_scan = sched::role_of<node_type<J>>() == sched::role::scan;
  template <std::size_t J>
  static constexpr bool is_prefix_scan = [] {
    if constexpr (is_scan<J>)
      return !fused_scan_parts<node_type<J>>::reverse;
    else
      return false;
  }();

  // The node of step J within the plan value.
  template <std::size_t J>
  static constexpr auto const& node_at(Plan const& p) {
    return sched::at_path(p, typename step<J>::path{});
  }

  // An earlier step of the same type, with values that may or may not equal
  // J's (compared at run time). A scan's twin (a decayed scan the backward
  // reads three times) has running sums of its own in the state: a backend
  // that shares the twin's rows hands J's sums the twin's too (they start
  // equal, as every scan of one state does, and add the same rows).
  template <std::size_t J, std::size_t... K>
  static constexpr std::size_t twin_of(std::index_sequence<K...>) {
    constexpr std::array<bool, sizeof...(K) + 1> same{std::is_same_v<node_type<K>, node_type<J>>..., true};
    std::size_t k = 0;
    while (!same[k]) ++k;
    return k == sizeof...(K) ? sched::none : k;
  }
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> twins(std::index_sequence<J...>) {
    return {twin_of<J>(std::make_index_sequence<J>{})..., sched::none};
  }
  static constexpr std::array<std::size_t, size + 1> twin = twins(std::make_index_sequence<size>{});

  // The position of each scan's running sums in the plan's state: a
  // forward's prefix scans carry its state across blocks of a sequence; a
  // backward's scans (prefix and suffix) start from the sums a chained
  // backward gives them (cpu::gradient with states).
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> scan_indices(std::index_sequence<J...>) {
    std::array<std::size_t, size + 1> s{};
    s.fill(sched::none);
    std::size_t k = 0;
    ((is_scan<J> ? void(s[J] = k++) : void()), ...);
    return s;
  }
  static constexpr std::array<std::size_t, size + 1> scan_index = scan_indices(std::make_index_sequence<size>{});
  static constexpr std::size_t prefix_scans = [] {
    std::size_t k = 0;
    [&]<std::size_t... J>(std::index_sequence<J...>) { ((k += is_prefix_scan<J>), ...); }(std::make_index_sequence<size>{});
    return k;
  }();

  // Fused groups of row-wise steps: step J is `absorbed` into its only reader K
  // when both are row-wise, K reads J's rows directly (no view between), and
  // J is no output and not shared: then J's rows are made and consumed one at
  // a time inside K's pass and never stored. chain_start[K] is the first step
  // of K's group (K itself when it absorbs nothing). A twin shares its first
  // twin's stored rows, so that one counts as read by it too — unless the twin
  // is itself absorbed: then it is never shared (its group's last step, a
  // twin of the other group's, is). So the backward's copies of a chain with
  // values, 0.125·S then exp then the mask, fuse as the first copy does.
  template <class... O>
  static constexpr void count_reads(std::array<std::size_t, size + 1>& c, detail::type_list<O...>) {
    ((sched::reads<O>::step != sched::none ? void(++c[sched::reads<O>::step]) : void()), ...);
  }
  template <std::size_t K>
  static constexpr std::size_t row_source() {  // the step row-wise K reads directly and could absorb, or none
    if constexpr (sched::row_wise<node_type<K>>()) {
      using O = detail::type_at_t<0, operands<K>>;
      if constexpr (requires { O::step; })
        return sched::row_wise<node_type<O::step>>() ? O::step : sched::none;
      else
        return sched::none;
    } else {
      return sched::none;
    }
  }
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> reader_counts(std::index_sequence<J...>) {
    std::array<std::size_t, size + 1> c{};
    (count_reads(c, operands<J>{}), ...);
    count_reads(c, outputs{});
    constexpr std::array<std::size_t, size + 1> source{row_source<J>()..., sched::none};
    std::array<bool, size + 1> fused{};  // a twin (no step shares it) read only by a row-wise step that absorbs it
    for (std::size_t k = 0; k < size; ++k)
      if (source[k] != sched::none && twin[source[k]] != sched::none && c[source[k]] == 1) fused[source[k]] = true;
    for (std::size_t j = 0; j < size; ++j)
      if (twin[j] != sched::none && !fused[j]) c[twin[j]] += 2;  // shared: never absorbed
    return c;
  }
  static constexpr std::array<std::size_t, size + 1> readers = reader_counts(std::make_index_sequence<size>{});
  template <std::size_t K>
  static constexpr std::size_t absorbs() {  // the step K absorbs, or none
    constexpr std::size_t o = row_source<K>();
    if constexpr (o != sched::none)
      return readers[o] == 1 ? o : sched::none;
    else
      return sched::none;
  }
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> absorbed_steps(std::index_sequence<J...>) {
    std::array<std::size_t, size + 1> a{};
    a.fill(sched::none);
    ((absorbs<J>() != sched::none ? void(a[absorbs<J>()] = J) : void()), ...);
    return a;
  }
  static constexpr std::array<std::size_t, size + 1> row_absorbed = absorbed_steps(std::make_index_sequence<size>{});
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> chain_starts(std::index_sequence<J...>) {
    std::array<std::size_t, size + 1> c{};
    ((c[J] = absorbs<J>() == sched::none ? J : c[absorbs<J>()]), ...);
    return c;
  }
  static constexpr std::array<std::size_t, size + 1> chain_start = chain_starts(std::make_index_sequence<size>{});

  // Scans that make their operands' rows or finish their output's: a fused
  // group (chain_start[G] ... G) whose only reader is a scan reading it
  // directly is made chunk by chunk as the scan loads rows (absorbed_by[G] is
  // the scan); a scan whose only reader is the first step of a group hands it
  // each finished chunk of rows (emits[scan] = the group's last step), unless
  // a scan loads that group. Neither stores an N-row temporary.
  template <class O>
  static constexpr std::size_t direct_step() {
    if constexpr (requires { O::step; })
      return O::step;
    else
      return sched::none;
  }
  template <std::size_t J>
  static constexpr bool is_row_wise = sched::row_wise<node_type<J>>();
  template <std::size_t G>
  static constexpr bool loadable = is_row_wise<G> && readers[G] == 1 && twin[G] == sched::none;
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> loaded_steps(std::index_sequence<J...>) {
    std::array<std::size_t, size + 1> a = row_absorbed;
    auto note = [&]<std::size_t Scan, class... O>(std::integral_constant<std::size_t, Scan>, detail::type_list<O...>) {
      ((direct_step<O>() != sched::none && loadable<direct_step<O>() % size> ? void(a[direct_step<O>()] = Scan)
                                                                             : void()),
       ...);
    };
    ((is_scan<J> ? note(std::integral_constant<std::size_t, J>{}, operands<J>{}) : void()), ...);
    return a;
  }
  // absorbed_by[J]: the step whose pass makes J's rows (a group's next step, or
  // a scan loading the group), or none.
  static constexpr std::array<std::size_t, size + 1> absorbed_by = loaded_steps(std::make_index_sequence<size>{});

  // A step with a twin may not run at all: when the values agree at run time
  // the backend hands it the twin's result and skips its turn, and with it
  // whatever else that turn would make. So a scan with a twin makes only its
  // own result: it emits no group (lone_scan) and hosts no paired scan
  // (dual_for), as a step with a twin absorbs no group (absorbs, loadable).
  // (A recomputed forward's scans have twins: a stack of three layers' backward
  // emitted layer 2's output from one and never made it.)
  template <std::size_t J>
  static constexpr bool hosts_others = twin[J] == sched::none;
  template <std::size_t J>
  static constexpr bool lone_scan =
      J != sched::none && is_scan<J % size> && readers[J % size] == 1 && hosts_others<J % size>;
  template <std::size_t F>
  static constexpr std::size_t emitting_scan() {  // the scan a group's first step F reads, when it may emit F's group
    if constexpr (is_row_wise<F> && chain_start[F] == F) {
      constexpr std::size_t j = direct_step<detail::type_at_t<0, operands<F>>>();
      return lone_scan<j> ? j : sched::none;
    } else if constexpr (sched::row_local_pair<node_type<F>>()) {
      // one operand the scan, the other ready before it (an input or an earlier step)
      constexpr std::size_t x = direct_step<detail::type_at_t<0, operands<F>>>();
      constexpr std::size_t y = direct_step<detail::type_at_t<1, operands<F>>>();
      constexpr std::size_t y_at = sched::reads<detail::type_at_t<1, operands<F>>>::step;
      constexpr std::size_t x_at = sched::reads<detail::type_at_t<0, operands<F>>>::step;
      if constexpr (lone_scan<x> && (y_at == sched::none || y_at < x))
        return x;
      else if constexpr (lone_scan<y> && (x_at == sched::none || x_at < y))
        return y;
      else
        return sched::none;
    } else {
      return sched::none;
    }
  }
  template <std::size_t... F>
  static constexpr std::array<std::size_t, size + 1> emitted_groups(std::index_sequence<F...>) {
    std::array<std::size_t, size + 1> e{};
    e.fill(sched::none);
    constexpr std::array<std::size_t, size + 1> scan_of{emitting_scan<F>()..., sched::none};
    for (std::size_t f = 0; f < size; ++f) {
      if (scan_of[f] == sched::none) continue;
      std::size_t end = f;
      while (row_absorbed[end] != sched::none) end = row_absorbed[end];
      if (absorbed_by[end] == sched::none && twin[end] == sched::none) e[scan_of[f]] = end;
    }
    return e;
  }
  static constexpr std::array<std::size_t, size + 1> emits = emitted_groups(std::make_index_sequence<size>{});

  // Where each step's result is computed before scans are paired (below).
  static constexpr std::array<std::size_t, size + 1> own_turn = [] {
    std::array<std::size_t, size + 1> r{};
    for (std::size_t j = size + 1; j-- > 0;) r[j] = absorbed_by[j] == sched::none ? j : r[absorbed_by[j]];
    for (std::size_t j = 0; j < size; ++j)
      if (emits[j] != sched::none)
        for (std::size_t k = 0; k < size; ++k)
          if (r[k] == emits[j]) r[k] = j;
    return r;
  }();

  // Paired scans: two suffix scans J < K whose running sums are transposes
  // of each other (K's B and C are J's C and B: the same steps or inputs),
  // as ∂K's and ∂V's in the backward of attention. K's turn runs both as one
  // scan (its state updated once; J's rows are its second output, the state
  // contracted over its columns), provided nothing that runs after J and up to
  // K reads J's result. dual_of[K] = J, else none. (Prefix scans keep their
  // own turns: their running sums are a plan's state.)
  // (Operands compare as their twins' when they have one: the backend pairs
  // such scans only when the twins' values are equal, same_value at run time.)
  template <class O>
  struct up_to_twin {
    using type = O;
  };
  template <std::size_t X>
  struct up_to_twin<sched::step_operand<X>> {
    using type = sched::step_operand<twin[X] == sched::none ? X : twin[X]>;
  };
  template <std::size_t J, std::size_t I>
  using operand_up_to_twin = typename up_to_twin<detail::type_at_t<I, operands<J>>>::type;
  template <std::size_t J, std::size_t K>  // (two suffix scans: dual_for asks of no other steps)
  static constexpr bool transposed_scans = std::is_same_v<operand_up_to_twin<J, 1>, operand_up_to_twin<K, 2>> &&
                                           std::is_same_v<operand_up_to_twin<J, 2>, operand_up_to_twin<K, 1>>;
  template <class... O>
  static constexpr bool reads_turn(std::size_t turn, detail::type_list<O...>) {  // an operand made in `turn`
    return ((sched::reads<O>::step != sched::none && own_turn[sched::reads<O>::step] == turn) || ...);
  }
  template <std::size_t... X>
  static constexpr bool read_between(std::size_t j, std::size_t k, std::index_sequence<X...>) {
    return ((own_turn[X] > j && own_turn[X] <= k && reads_turn(j, operands<X>{})) || ...);
  }
  // (Only suffix scans pair: the candidates are listed first, so that the
  // pairs tried are theirs alone, not every pair of steps; a deep stack's
  // backward has ~150 steps and a few dozen suffix scans.)
  static constexpr std::array<bool, size + 1> is_suffix_scan = []<std::size_t... J>(std::index_sequence<J...>) {
    return std::array<bool, size + 1>{(is_scan<J> && !is_prefix_scan<J>)..., false};
  }(std::make_index_sequence<size>{});
  static constexpr std::size_t suffix_scans = [] {
    std::size_t k = 0;
    for (bool b : is_suffix_scan) k += b;
    return k;
  }();
  static constexpr std::array<std::size_t, suffix_scans> suffix_scan_steps = [] {
    std::array<std::size_t, suffix_scans> s{};
    for (std::size_t j = 0, k = 0; j < size; ++j)
      if (is_suffix_scan[j]) s[k++] = j;
    return s;
  }();
  // The first suffix scan before the KI-th that K = suffix_scan_steps[KI] may host, or none.
  template <std::size_t KI, std::size_t... JI>
  static constexpr std::size_t dual_for(std::index_sequence<JI...>) {
    [[maybe_unused]] constexpr std::size_t K = suffix_scan_steps[KI];  // (unread when KI = 0)
    constexpr std::array<bool, sizeof...(JI) + 1> fits{
        (hosts_others<K> && transposed_scans<suffix_scan_steps[JI], K> &&
         !read_between(suffix_scan_steps[JI], K, std::make_index_sequence<size>{}))...,
        true};
    std::size_t j = 0;
    while (!fits[j]) ++j;
    return j == sizeof...(JI) ? sched::none : suffix_scan_steps[j];
  }
  static constexpr std::array<std::size_t, size + 1> dual_of = []<std::size_t... KI>(std::index_sequence<KI...>) {
    std::array<std::size_t, size + 1> d{};
    d.fill(sched::none);
    ((d[suffix_scan_steps[KI]] = dual_for<KI>(std::make_index_sequence<KI>{})), ...);
    for (std::size_t k = 0; k < size; ++k)  // each scan in one pair at most (the first that fits)
      for (std::size_t i = 0; i < k; ++i)
        if (d[k] != sched::none && d[i] != sched::none && (d[i] == d[k] || i == d[k])) d[k] = sched::none;
    return d;
  }(std::make_index_sequence<suffix_scans>{});

  // runs_in[J]: the step whose turn computes J's result (J itself, unless
  // its rows are made in another step's pass, or its scan runs paired in a
  // later one's); a backend runs only the steps with runs_in[J] == J.
  static constexpr std::array<std::size_t, size + 1> runs_in = [] {
    std::array<std::size_t, size + 1> r = own_turn;
    for (std::size_t k = 0; k < size; ++k)
      if (dual_of[k] != sched::none)
        for (std::size_t x = 0; x < size; ++x)
          if (own_turn[x] == dual_of[k]) r[x] = k;
    return r;
  }();

  // The last step that reads each step's result (size: an output, read at the
  // end), a read counted at the reader's turn (runs_in); a twin lives as long
  // as the steps that may share it.
  template <class... O>
  static constexpr void note_reads(std::array<std::size_t, size + 1>& u, std::size_t at, detail::type_list<O...>) {
    ((sched::reads<O>::step != sched::none && u[sched::reads<O>::step] < at ? void(u[sched::reads<O>::step] = at)
                                                                            : void()),
     ...);
  }
  template <std::size_t... J>
  static constexpr std::array<std::size_t, size + 1> last_uses(std::index_sequence<J...>) {
    std::array<std::size_t, size + 1> u{};
    (note_reads(u, runs_in[J], operands<J>{}), ...);
    note_reads(u, size, outputs{});
    for (std::size_t j = size; j-- > 0;)
      if (twin[j] != sched::none && row_absorbed[j] == sched::none && u[twin[j]] < u[j]) u[twin[j]] = u[j];
    return u;
  }
  static constexpr std::array<std::size_t, size + 1> last_use = last_uses(std::make_index_sequence<size>{});

};

// The plan's scan nodes in the order of its state (the schedule's order): a
// forward's prefix scans; a backward's prefix and suffix scans.
namespace sched {
template <class Plan, class J>
struct state_scans_impl;
template <class Plan, std::size_t... J>
struct state_scans_impl<Plan, std::index_sequence<J...>> {
  using S = schedule_of<Plan>;
  template <std::size_t I>
  using scan_node = std::remove_cvref_t<decltype(kid<1>(std::declval<typename S::template node_type<I>>()))>;
  template <std::size_t I>
  static auto pick() {
    if constexpr (S::template is_scan<I>)
      return type_list<scan_node<I>>{};
    else
      return type_list<>{};
  }
  using type = typename concat_lists<decltype(pick<J>())...>::type;
};
}  // namespace sched
template <class Plan>
using state_scans =
    typename sched::state_scans_impl<Plan, std::make_index_sequence<schedule_of<Plan>::size>>::type;

// ---- resolving run-time choices ------------------------------------------------------
// The distinct run-time choices of a plan: each (dimension, threshold) once,
// since every select with the same key and threshold takes the same branch.
// Made over the tree's structure, each subtree's list once (a template is
// instantiated once per type): its depth is the tree's, where a fold over
// every node, repeats included, was as deep as the tree has nodes — past the
// compiler's limit for a three-layer stack's backward.
template <class N>
struct selects_of : selects_of<std::remove_cvref_t<N>> {};
template <class Op, class... K>
struct selects_of<node<Op, K...>> {
  using own = std::conditional_t<is_select_op<Op>, detail::type_list<Op>, detail::type_list<>>;
  using type = typename detail::merge_unique<
      own, typename detail::concat_lists<detail::type_list<>, typename selects_of<K>::type...>::type>::type;
};

namespace sched {
// The plan with every select replaced by its branch under `Mask` (bit i set:
// select i of Selects takes its first, short-sequence branch).
template <class Selects, std::size_t Mask, class N>
constexpr auto resolve(N const& n) {
  using Op = typename N::op_type;
  if constexpr (!contains_select<N>) {
    return n;  // (not rebuilt node by node: a function per node type, for the compiler)
  } else if constexpr (is_select_op<Op>) {
    constexpr std::size_t bit = detail::index_of_v<Op, Selects>;
    if constexpr ((Mask >> bit) & 1u)
      return resolve<Selects, Mask>(kid<0>(n));
    else
      return resolve<Selects, Mask>(kid<1>(n));
  } else {
    return unpack_kids(n, [&](auto const&... k) { return make_node(n.op, resolve<Selects, Mask>(k)...); });
  }
}
template <class Selects, std::size_t Mask, class N, class F>
decltype(auto) dispatch(std::size_t mask, N const& n, F&& f) {
  if constexpr (Mask + 1 == (std::size_t(1) << Selects::size)) {
    return f(resolve<Selects, Mask>(n));
  } else {
    if (mask == Mask) return f(resolve<Selects, Mask>(n));
    return dispatch<Selects, Mask + 1>(mask, n, f);
  }
}
}  // namespace sched

// f(plan with every select resolved for these extents): one decision per
// distinct choice, made once per call on the host; kernels never see a select.
// `table` is an extent source (`template <class D> get()`).
template <class N, class Table, class F>
decltype(auto) with_resolved_plan(N const& n, Table const& table, F&& f) {
  using selects = typename selects_of<N>::type;
  static_assert(selects::size <= 4, "lina: a plan with more than four distinct run-time choices");
  std::size_t mask = 0;
  [&]<class... S>(detail::type_list<S...>) {
    std::size_t bit = 0;
    ((mask |= (table.template get<typename S::key>() < S::threshold ? std::size_t(1) : 0) << bit++), ...);
  }(selects{});
  return sched::dispatch<selects, 0>(mask, n, f);
}

}  // namespace lina
