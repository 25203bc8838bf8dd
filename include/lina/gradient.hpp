// gradient(plan): reverse-mode differentiation of a plan, at compile time.
//
// Each op has one adjoint rule (op_traits<Op>::adjoint, op_traits.hpp) that
// maps the cotangent G of its output to the cotangents of its kids, written in
// the same plan vocabulary:
//
//   A·B          -> G·Bᵀ, Aᵀ·G            φ(X)         -> φ′(X)⊙G (J_φ(X)ᵀG per row)
//   φ(X; W)      -> φ_vjp(X, W, G), Xᵀ·φ_w′(X, W, G)
//   Xᵀ           -> Gᵀ                    s·X          -> s·G
//   causal(S)    -> causal(G)             exp(X)       -> G⊙exp(X)
//   normalize(S) -> normalize′(S, G)      rowdiv(Y)    -> rowdiv′(Y, G)   (quotient rule)
//   [X|1]        -> dropcol(G)            contract(A, S) -> contract(G, rowsᵀ(S)), A⊗G
//   prefix(S)    -> suffix(G)             suffix(S)    -> prefix(G)
//   B⊗C          -> contract(C, rowsᵀ(G)), contract(B, G)
//
// The cotangent of the output is the input symbol "dout". Contributions to
// one input are summed; a small table then moves transposes of per-row
// matrices inside scans (rowsᵀ(prefix(B⊗C)) = prefix(C⊗B)). Run-time selects
// are first hoisted to the top of the plan, so each branch is differentiated
// on its own and the backward plan selects between the two backward plans.
//
// For the causal linear plan rowdiv(contract(φQ, prefix(φK⊗[V|1]))) this
// yields the paper's result: ∂φQ from the prefix sum of [V|1]_j φ(K)_jᵀ, and
// ∂φK, ∂V from suffix sums of dY_j φ(Q)_jᵀ, each a fused scan with a C x (M+1)
// state, so the backward needs no per-step state cache.
#pragma once

#include <boost/hana/drop_front.hpp>
#include <boost/hana/filter.hpp>
#include <boost/hana/flatten.hpp>
#include <boost/hana/fold_left.hpp>
#include <boost/hana/front.hpp>
#include <boost/hana/range.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/zip_with.hpp>
#include <algorithm>
#include <array>
#include <boost/hana/for_each.hpp>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "lina/compile.hpp"
#include "lina/format.hpp"
#include "lina/node.hpp"
#include "lina/rewrite.hpp"

namespace lina {

namespace hana = boost::hana;

inline constexpr fixed_string cotangent_symbol = "dout";

// ∂L/∂In, as an expression over the inputs and dout.
template <class In, class E>
struct gradient_entry {
  using input = In;
  E expr;
};

// The gradients of every input of a forward plan (in the order of inputs_of).
template <class Forward, class... Entries>
struct backward_plan {
  using forward_type = Forward;
  Forward forward;
  hana::basic_tuple<Entries...> entries;

  // g[Q]: the gradient expression of input Q.
  template <class Op>
  constexpr auto const& operator[](node<Op> const&) const {
    constexpr std::size_t i = detail::index_of_v<Op, detail::type_list<typename Entries::input...>>;
    static_assert(i < sizeof...(Entries), "lina: this input is not an input of the differentiated plan");
    return hana::at_c<i>(entries).expr;
  }
};

template <class T>
inline constexpr bool is_backward_plan = false;
template <class F, class... E>
inline constexpr bool is_backward_plan<backward_plan<F, E...>> = true;


namespace rules {
using namespace rewrite;
// Tidying derived gradients: transposes to the leaves, per-row transposes
// into the scans. Products keep their bracketing (the order of the forward
// plan is the order of its backward).
inline constexpr auto adjoint_rules = hana::make_tuple(
    rule(transpose(transpose(x_)), x_),                                                  //
    rule(transpose(x_ * y_), transpose(y_) * transpose(x_)),                              //
    rule(transpose(s_ * x_), s_ * transpose(x_)),                                        //
    rule(build::rows_transpose(build::rows_transpose(x_)), x_),                          //
    rule(build::rows_transpose(prefix_(x_)), prefix_(build::rows_transpose(x_))),  //
    rule(build::rows_transpose(suffix_(x_)), suffix_(build::rows_transpose(x_))),  //
    rule(build::rows_transpose(build::outer(x_, y_)), build::outer(y_, x_)));
}  // namespace rules

namespace detail {

// (input, contribution) pairs of the cotangent g flowing into n.
template <class N, class G>
constexpr auto backprop(N const& n, G const& g) {
  using Op = typename N::op_type;
  if constexpr (is_input_op_v<Op>) {
    return hana::make_tuple(gradient_entry<Op, G>{g});
  } else {
    auto cot = op_traits<Op>::adjoint(n, g);
    return hana::flatten(hana::zip_with([](auto const& k, auto const& c) { return backprop(k, c); },
                                        rewrite::kids_tuple(n), cot));
  }
}

template <class In, class Contributions>
constexpr auto sum_for(Contributions const& c) {
  auto mine = hana::filter(c, [](auto const& e) {
    return hana::bool_c<std::is_same_v<typename std::remove_cvref_t<decltype(e)>::input, In>>;
  });
  auto total = hana::fold_left(hana::drop_front(mine), hana::front(mine).expr,
                               [](auto const& acc, auto const& e) { return build::add(acc, e.expr); });
  auto tidy = rewrite::rewrite(rules::adjoint_rules, total);
  return gradient_entry<In, decltype(tidy)>{tidy};
}

// op(.., select(a, b), ..) -> select(op(.., a, ..), op(.., b, ..)), bottom-up.
template <class N>
constexpr auto hoist_selects(N const& n);

template <std::size_t I, class N>
constexpr auto hoist_at(N const& n) {
  if constexpr (I == N::arity) {
    return n;
  } else {
    using K = std::remove_cvref_t<decltype(kid<I>(n))>;
    if constexpr (is_select_op<typename K::op_type> && !is_select_op<typename N::op_type>) {
      auto with = [&](auto const& branch) {
        return hana::unpack(hana::make_range(hana::size_c<0>, hana::size_c<N::arity>), [&](auto... j) {
          return make_node(n.op, [&] {
            if constexpr (decltype(j)::value == I)
              return branch;
            else
              return kid<decltype(j)::value>(n);
          }()...);
        });
      };
      return make_node(kid<I>(n).op, hoist_selects(with(kid<0>(kid<I>(n)))), hoist_selects(with(kid<1>(kid<I>(n)))));
    } else {
      return hoist_at<I + 1>(n);
    }
  }
}

template <class N>
constexpr auto hoist_selects(N const& n) {
  if constexpr (!contains_select<N>) {
    return n;  // (not rebuilt node by node: a function per node type, for the compiler)
  } else {
    auto kids_done = unpack_kids(n, [&](auto const&... k) { return make_node(n.op, hoist_selects(k)...); });
    return hoist_at<0>(kids_done);
  }
}

// The gradient entries of every input (in the order of inputs_of) of a plan.
template <class Inputs>
struct differentiate;
template <class... In>
struct differentiate<detail::type_list<In...>> {
  template <class P>
  static constexpr auto run(P const& p) {
    using Op = typename P::op_type;
    if constexpr (is_select_op<Op>) {  // the same choice between the two backward plans
      return hana::zip_with(
          [&](auto const& small, auto const& large) {
            auto e = make_node(p.op, small.expr, large.expr);
            return gradient_entry<typename std::remove_cvref_t<decltype(small)>::input, decltype(e)>{e};
          },
          run(kid<0>(p)), run(kid<1>(p)));
    } else {
      using S = typename P::shape;
      constexpr node<op::input<cotangent_symbol, typename S::rows, typename S::cols>> dout{};
      auto contributions = backprop(p, dout);
      return hana::make_tuple(sum_for<In>(contributions)...);
    }
  }
};

template <class... T>
struct first_non_void {
  using type = void;
};
template <class T, class... R>
struct first_non_void<T, R...> {
  using type = std::conditional_t<std::is_void_v<T>, typename first_non_void<R...>::type, T>;
};
// The first op of a plan without an adjoint rule (inputs and selects need none), or void.
template <class N>
struct first_without_adjoint;
template <class Op, class... K>
struct first_without_adjoint<node<Op, K...>> {
  using type = typename first_non_void<
      std::conditional_t<!differentiable_op<Op> && !is_input_op_v<Op> && !is_select_op<Op>, Op, void>,
      typename first_without_adjoint<K>::type...>::type;
};
}  // namespace detail

namespace diagnose {
template <class Op>
struct adjoint_rule {
  static_assert(std::is_void_v<Op>,
                "lina::gradient: no adjoint rule for this node (its op is in the instantiation of "
                "lina::diagnose::adjoint_rule above); the backward-only nodes (φ′, rowdiv′, normalize′, ⊙, +, "
                "dropcol) cannot be differentiated again");
  static constexpr bool ok = std::is_void_v<Op>;
};
template <bool NoClash, bool BaseDims>
struct differentiable_plan {
  static_assert(NoClash, "lina::gradient: \"dout\" names the output's cotangent; rename the input called dout");
  static_assert(!NoClash || BaseDims,
                "lina::gradient: the output's rows and columns must be dimensions of the inputs (dout is bound "
                "with that shape)");
  static constexpr bool ok = NoClash && BaseDims;
};
}  // namespace diagnose

// gradient(plan) -> backward_plan: g[Q] is ∂L/∂Q given dout = ∂L/∂out.
template <class P>
  requires is_node<P>
constexpr auto gradient(P const& plan) {
  if constexpr (!diagnose::adjoint_rule<typename detail::first_without_adjoint<P>::type>::ok) {
    return backward_plan<P>{plan, {}};  // diagnosed above; nothing more to say
  } else {
    using S = typename P::shape;
    constexpr bool no_clash = []<class... I>(detail::type_list<I...>) {
      return ((I::name != cotangent_symbol) && ...);
    }(inputs_of<P>{});
    static_assert(diagnose::differentiable_plan<no_clash, concepts::base_dimension<typename S::rows> &&
                                                              concepts::base_dimension<typename S::cols>>::ok ||
                  true);
    auto hoisted = detail::hoist_selects(plan);
    auto entries = detail::differentiate<inputs_of<P>>::run(hoisted);
    return hana::unpack(entries, [&](auto const&... e) {
      return backward_plan<P, std::remove_cvref_t<decltype(e)>...>{plan, hana::make_basic_tuple(e...)};
    });
  }
}

// ---- what every backend needs to run a backward plan -----------------------------

// The gradients of one backward evaluation, in a backend's tensor type: g[Q]
// is ∂L/∂Q, shaped like Q (and, on the CPU, laid out like the tensor bound to Q).
template <class Tensor, class... In>
class gradients {
 public:
  template <class Op>
  Tensor const& operator[](node<Op> const&) const {
    return tensors_[index<Op>()];
  }
  template <class Op>
  Tensor& operator[](node<Op> const&) {
    return tensors_[index<Op>()];
  }
  std::array<Tensor, sizeof...(In)>& all() { return tensors_; }
  std::array<Tensor, sizeof...(In)> const& all() const { return tensors_; }

 private:
  template <class Op>
  static constexpr std::size_t index() {
    constexpr std::size_t i = detail::index_of_v<Op, detail::type_list<In...>>;
    static_assert(i < sizeof...(In), "lina: this input is not an input of the differentiated plan");
    return i;
  }
  std::array<Tensor, sizeof...(In)> tensors_;
};

namespace detail {
template <class Tensor, class F, class... E>
auto make_gradients(backward_plan<F, E...> const*) -> gradients<Tensor, typename E::input...>;
}  // namespace detail
template <class Tensor, class BP>
using gradients_of = decltype(detail::make_gradients<Tensor>(static_cast<BP const*>(nullptr)));

// The same type from a forward plan's inputs alone (gradient(plan) has an
// entry per input of inputs_of<P>, in that order), without deriving the
// backward plan: for a backend whose backward does not run the derived plan
// (CUDA's comes from the plan's spec), the derivation would be compile time
// spent on a type.
namespace detail {
template <class Tensor, class... In>
auto make_gradients(type_list<In...> const*) -> gradients<Tensor, In...>;
}  // namespace detail
template <class Tensor, class P>
using gradients_for = decltype(detail::make_gradients<Tensor>(static_cast<inputs_of<P> const*>(nullptr)));

// A backward plan as one plan: bundle(forward, ∂In…). Its schedule computes
// every gradient, sharing what they have in common (the recomputed forward
// pass, rowdiv′, φ(Q), …); the forward plan rides along as the first kid so
// that every input it uses counts as bound, even one no gradient reads.
template <class F, class... E>
constexpr auto as_bundle(backward_plan<F, E...> const& bp) {
  return hana::unpack(bp.entries, [&](auto const&... e) { return make_node(op::bundle{}, bp.forward, e.expr...); });
}

// The backward plan of a plan (or the backward plan itself).
template <class P>
constexpr auto backward_of(P const& plan) {
  if constexpr (is_backward_plan<P>)
    return plan;
  else
    return gradient(plan);
}

// No N x N matrix, and per-row sequences only inside a fused scan
// contract(A, prefix|suffix(B⊗C)): the plan runs in O(N) time with a state of
// one C x M matrix, never a per-step cache.
template <class E, class Key>
constexpr bool constant_state() {
  std::size_t sequences = 0, fused = 0;
  bool well_formed = true;
  detail::visit_types<E>([&]<class X>() {
    if constexpr (X::shape::rank == 3) ++sequences;
    if constexpr (std::is_same_v<typename X::op_type, op::contract_rows>) {
      if constexpr (fused_scan_parts<X>::fused)
        fused += 2;  // the scan and its outer product
      else
        well_formed = false;
    }
  });
  return !has_square<E, Key>() && well_formed && sequences == fused;
}

template <class BP, class Key>
constexpr bool backward_is_constant_state() {
  return []<class F, class... E>(backward_plan<F, E...>*) {
    return (constant_state<decltype(std::declval<E>().expr), Key>() && ...);
  }(static_cast<BP*>(nullptr));
}

namespace detail {
// Visit every subtree value, parents first; f returns whether to descend.
template <class N, class F>
void walk(N const& n, F& f) {
  if (f(n)) for_each_kid(n, [&](auto const& k) { walk(k, f); });
}

// Counts how often each subtree occurs, by identity (type and values); a named
// subtree counts once more where it is used, and its definition (its kids) once.
struct repeat_counter {
  print_names const& names;
  struct seen {
    node_identity id;
    int count;
    std::size_t size;  // printed length: the largest repeat is named first
  };
  std::vector<seen> counts;
  std::vector<void const*> defined;

  template <class N>
  bool operator()(N const& n) {
    if (names.find(typeid(N), &n)) {
      bool first = false;
      for (auto const& e : names.named)
        if (e.id.is(typeid(N), &n) && std::find(defined.begin(), defined.end(), e.id.node) == defined.end()) {
          defined.push_back(e.id.node);
          first = true;
        }
      if (first) for_each_kid(n, [&](auto const& k) { walk(k, *this); });
      return false;
    }
    auto it = std::find_if(counts.begin(), counts.end(), [&](seen const& c) { return c.id.is(typeid(N), &n); });
    if (it == counts.end())
      counts.push_back(seen{node_identity::of(n), 1, to_string(n).size()});
    else
      ++it->count;
    return true;
  }
};

// Name the subtrees a backward plan repeats (largest first), so that its
// printed form shows the shared forward pass once.
template <class BP>
print_names name_repeats(BP const& bp) {
  print_names names;
  for (;;) {
    repeat_counter counter{names, {}, {}};
    hana::for_each(bp.entries, [&](auto const& e) { walk(e.expr, counter); });
    repeat_counter::seen const* best = nullptr;
    for (auto const& c : counter.counts)
      if (c.count >= 2 && c.size >= 24 && (!best || c.size > best->size)) best = &c;
    if (!best) return names;
    names.named.push_back({best->id, fmt::format("t{}", names.named.size() + 1)});
  }
}
}  // namespace detail

// The backward plan as text: one line per input, then the named subtrees.
template <class F, class... E>
std::string to_string(backward_plan<F, E...> const& bp) {
  detail::printer p;
  detail::print_names names = detail::name_repeats(bp);
  p.names = &names;
  hana::for_each(bp.entries, [&](auto const& e) {
    using In = typename std::remove_cvref_t<decltype(e)>::input;
    p.text("∂");
    p.text(In::name.view());
    p.text(" = ");
    p(e.expr);
    p.text("\n");
  });
  // definitions: each named subtree's top node plainly, its kids with names
  for (auto const& entry : names.named) {
    bool done = false;
    auto def = [&](auto const& n) {
      if (done) return false;
      if (!entry.id.is(typeid(n), &n)) return true;
      p.text(entry.name);
      p.text(" = ");
      p.node(n);
      p.text("\n");
      done = true;
      return false;
    };
    hana::for_each(bp.entries, [&](auto const& e) { detail::walk(e.expr, def); });
  }
  return std::move(p.out);
}

}  // namespace lina

template <class F, class... E>
struct fmt::formatter<lina::backward_plan<F, E...>> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(lina::backward_plan<F, E...> const& bp, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(lina::to_string(bp), ctx);
  }
};
