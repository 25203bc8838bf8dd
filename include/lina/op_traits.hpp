// One traits struct per operation: everything the DSL knows about an op, in
// one place. A backend's lowering (cpu::lower<Op>) is the only per-op fact
// kept elsewhere, since it belongs to the backend.
//
//   op_traits<Op>::name                          a short name ("product", "prefix")
//   op_traits<Op>::precedence                    prec::sum < prec::product < prec::atom
//   op_traits<Op>::print(n, p)                   writes node n through printer p (format.hpp)
//   op_traits<Op>::cost<S, KS...>(src, elem)     the node's own flops and bytes of
//                                                intermediates (S its shape, KS its kids')
//   op_traits<Op>::adjoint(n, g)                 one cotangent per kid, given the node's
//                                                cotangent g (reverse mode, gradient.hpp)
//
// Counting convention for cost (docs/architecture.md): a multiply-add is 2
// flops; bytes are those of materialised intermediates (inputs and views are
// free); a scan's state counts once (a x b), never per row. The default cost
// is an element-wise pass over the result, in place. Ops without `adjoint`
// (the backward-only ones) cannot be differentiated again.
#pragma once

#include <boost/hana/tuple.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <string_view>

#include "lina/feature_maps.hpp"
#include "lina/node.hpp"

namespace lina {

namespace hana = boost::hana;

enum class prec { sum = 1, product = 2, atom = 3 };

struct cost_estimate {
  double flops = 0;
  double bytes = 0;
  // The part of `flops` done inside fused scans (contract, prefix/suffix, ⊗),
  // which a backend may run at another rate than products (cpu::cost_model).
  double scan_flops = 0;
  // The part of `flops` in products half of whose terms a causal mask zeroes
  // (the left operand is a mask's result, or a mask reads the product):
  // backends that skip the masked triangle do about half of them.
  double masked_flops = 0;
  constexpr cost_estimate& operator+=(cost_estimate const& o) {
    flops += o.flops;
    bytes += o.bytes;
    scan_flops += o.scan_flops;
    masked_flops += o.masked_flops;
    return *this;
  }
};

namespace detail {
template <class D, class Source>
constexpr double ext(Source const& s) {
  return static_cast<double>(D::extent(s));
}
template <class S, class Src>
constexpr double elements(Src const& s) {
  return ext<typename S::rows>(s) * ext<typename S::cols>(s);
}

// Values print exactly: fmt's "{}" is the shortest decimal that reads back as the same double.
inline constexpr double default_eps = 1e-6;
// "; eps=…" after the operands when eps is not the default.
inline std::string eps_suffix(double eps) { return eps == default_eps ? std::string() : fmt::format("; eps={}", eps); }
template <class Map>
std::string map_tag() {
  return fmt::format("[{}]", std::string_view(Map::name));
}

// Building blocks of the traits below.
struct elementwise_cost {  // one pass over the result, in place
  template <class S, class... KS, class Src>
  static constexpr cost_estimate cost(Src const& s, double) {
    return {elements<S>(s), 0};
  }
};
struct free_cost {  // views, inputs, masks applied in place
  template <class S, class... KS, class Src>
  static constexpr cost_estimate cost(Src const&, double) {
    return {};
  }
};
template <fixed_string Name, prec Prec = prec::atom>
struct named {
  static constexpr std::string_view name = Name.view();
  static constexpr prec precedence = Prec;
};
// Ops printed as name(kid, kid, …).
template <fixed_string Name>
struct call_notation : named<Name> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(Name.view(), n);
  }
};
// name(kid, …; eps=…) when eps is not the default.
template <fixed_string Name>
struct eps_call_notation : named<Name> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(Name.view(), n, eps_suffix(n.op.eps));
  }
};
// name(kid; decay=…) when the decay is not 1 (masks and scans).
template <fixed_string Name>
struct decay_call_notation : named<Name> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    if constexpr (requires { n.op.decays; })
      p.call(Name.view(), n, fmt::format("; decay per head=[{}]", fmt::join(*n.op.decays, ", ")));
    else
      p.call(Name.view(), n, n.op.decay == 1 ? std::string() : fmt::format("; decay={}", n.op.decay));
  }
};
// Ops printed as kid SYMBOL kid.
template <fixed_string Name, fixed_string Symbol, prec Prec = prec::product>
struct infix_notation : named<Name, Prec> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p(kid<0>(n), Prec == prec::sum ? prec::sum : prec::atom);
    p.text(Symbol.view());
    p(kid<1>(n), Prec == prec::sum ? prec::product : prec::atom);
  }
};
}  // namespace detail

template <class Op>
struct op_traits {};  // an op without traits has no printed form (format.hpp says so)

// Can a node of this op be differentiated (does its traits have an adjoint)?
template <class Op>
concept differentiable_op = requires { op_traits<Op>::differentiable; };

// ---- expression vocabulary ----------------------------------------------------------
template <fixed_string Name, class R, class C>
struct op_traits<op::input<Name, R, C>> : detail::named<"input">, detail::free_cost {
  template <class N, class P>
  static void print(N const&, P& p) {
    p.text(Name.view());
  }
};
// φ[elu+1](Q), φ[favor](Q; W): the map is part of the printed plan, so two
// plans that differ only in their map never print alike.
template <class Map>
struct op_traits<op::phi<Map>> : detail::named<"phi"> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text("φ");
    p.text(detail::map_tag<Map>());
    p.text("(");
    p(kid<0>(n));
    if constexpr (N::arity == 2) {
      p.text("; ");
      p(kid<1>(n));
    }
    p.text(")");
  }
  // one function per feature; a parametric map first projects x W
  template <class S, class X, class... W, class Src>
  static constexpr cost_estimate cost(Src const& s, double elem) {
    double n = detail::elements<S>(s);
    if constexpr (sizeof...(W) == 1) {
      using Wt = std::tuple_element_t<0, std::tuple<W...>>;
      double r = detail::ext<typename S::rows>(s);
      return {2 * r * detail::ext<typename X::cols>(s) * detail::ext<typename Wt::cols>(s) + n, n * elem};
    } else {
      return {n, n * elem};
    }
  }
  // φ(X) -> φ′(X)⊙G (J_φ(X_i)ᵀ G_i per row); φ(X; W) -> φ_vjp(X, W, G), Xᵀ·φ_w′(X, W, G),
  // or, for a map differentiated from its values, with H = φ_z′(W, φ(X; W), G)
  // (one step, read twice), φ_dx(X, W, H), Xᵀ·H
  static constexpr bool differentiable = true;
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    if constexpr (N::arity == 2 && concepts::value_differentiable<Map>) {
      auto h = make_node(op::phi_grad_z<Map>{}, kid<1>(n), n, g);
      return hana::make_tuple(make_node(op::phi_dx<Map>{}, kid<0>(n), kid<1>(n), h),
                              make_node(op::product{}, make_node(op::transpose{}, kid<0>(n)), h));
    } else if constexpr (N::arity == 2)
      return hana::make_tuple(make_node(op::phi_vjp<Map>{}, kid<0>(n), kid<1>(n), g),
                              make_node(op::product{}, make_node(op::transpose{}, kid<0>(n)),
                                        make_node(op::phi_param_vjp<Map>{}, kid<0>(n), kid<1>(n), g)));
    else
      return hana::make_tuple(make_node(op::phi_vjp<Map>{}, kid<0>(n), g));
  }
};
template <>
struct op_traits<op::transpose> : detail::named<"transpose">, detail::free_cost {  // a view
  template <class N, class P>
  static void print(N const& n, P& p) {
    p(kid<0>(n), prec::atom);
    p.text("ᵀ");
  }
  static constexpr bool differentiable = true;  // Xᵀ -> Gᵀ
  template <class N, class G>
  static constexpr auto adjoint(N const&, G const& g) {
    return hana::make_tuple(make_node(op::transpose{}, g));
  }
};
// A product kid of a product keeps its parentheses: the bracketing is the order.
template <>
struct op_traits<op::product> : detail::infix_notation<"product", "·"> {
  template <class S, class A, class B, class Src>
  static constexpr cost_estimate cost(Src const& s, double elem) {
    double r = detail::ext<typename A::rows>(s), k = detail::ext<typename A::cols>(s),
           c = detail::ext<typename B::cols>(s);
    return {2 * r * k * c, r * c * elem};
  }
  static constexpr bool differentiable = true;  // A·B -> G·Bᵀ, Aᵀ·G
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(make_node(op::product{}, g, make_node(op::transpose{}, kid<1>(n))),
                            make_node(op::product{}, make_node(op::transpose{}, kid<0>(n)), g));
  }
};
template <class D>
struct op_traits<op::causal_t<D>> : detail::decay_call_notation<"causal">, detail::free_cost {  // zeroes in place
  static constexpr bool differentiable = true;  // causal(S) -> causal(G), the same decay
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(make_node(n.op, g));
  }
};
template <>
struct op_traits<op::normalize> : detail::eps_call_notation<"normalize"> {
  template <class S, class X, class Src>
  static constexpr cost_estimate cost(Src const& s, double) {
    return {2 * detail::elements<S>(s), 0};
  }
  static constexpr bool differentiable = true;  // normalize(S) -> normalize′(S, G) (quotient rule)
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(make_node(op::normalize_vjp{n.op.eps}, kid<0>(n), g));
  }
};
template <>
struct op_traits<op::scale> : detail::named<"scale", prec::product>, detail::elementwise_cost {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text(fmt::format("{}·", n.op.factor));
    p(kid<0>(n), prec::atom);
  }
  static constexpr bool differentiable = true;  // s·X -> s·G
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(make_node(n.op, g));
  }
};
template <>
struct op_traits<op::exp> : detail::call_notation<"exp">, detail::elementwise_cost {
  static constexpr bool differentiable = true;  // exp(X) -> G⊙exp(X)
  // A cotangent that is masked, causal(A) (exp read through a mask: causal
  // softmax), moves its mask onto exp: causal(A)⊙exp(X) = A⊙causal(exp(X)),
  // the forward's own masked exp, so the backward never needs exp where the
  // forward masked it (a key past the diagonal may overflow there).
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    if constexpr (is_causal_op<typename G::op_type>)
      return hana::make_tuple(build::hadamard(kid<0>(g), make_node(g.op, n)));
    else
      return hana::make_tuple(build::hadamard(g, n));
  }
};
template <>
struct op_traits<op::chain> : detail::call_notation<"chain"> {
  template <class S, class... KS, class Src>
  static constexpr cost_estimate cost(Src const&, double) {
    static_assert(detail::always_false<S>, "lina: a product chain has no cost until compile() brackets it");
    return {};
  }
};

// ---- plan vocabulary -----------------------------------------------------------------
template <>
struct op_traits<op::append_ones> : detail::named<"append_ones"> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text("[");
    p(kid<0>(n));
    p.text("|1]");
  }
  template <class S, class X, class Src>
  static constexpr cost_estimate cost(Src const& s, double elem) {
    return {0, detail::elements<S>(s) * elem};
  }
  static constexpr bool differentiable = true;  // [X|1] -> dropcol(G)
  template <class N, class G>
  static constexpr auto adjoint(N const&, G const& g) {
    return hana::make_tuple(build::drop_last(g));
  }
};
template <>
struct op_traits<op::row_divide> : detail::eps_call_notation<"rowdiv"> {
  template <class S, class X, class Src>
  static constexpr cost_estimate cost(Src const& s, double elem) {
    double n = detail::elements<S>(s);
    return {n, n * elem};
  }
  static constexpr bool differentiable = true;  // rowdiv(Y) -> rowdiv′(Y, G) (quotient rule)
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(make_node(op::row_divide_vjp{n.op.eps}, kid<0>(n), g));
  }
};
template <>
struct op_traits<op::outer_rows> : detail::infix_notation<"outer_rows", "⊗"> {
  template <class S, class B, class C, class Src>  // one multiply per state entry and row
  static constexpr cost_estimate cost(Src const& s, double) {
    double f = detail::ext<typename S::rows>(s) * detail::ext<typename S::a>(s) * detail::ext<typename S::b>(s);
    return {f, 0, f};
  }
  static constexpr bool differentiable = true;  // B⊗C -> contract(C, rowsᵀ(G)), contract(B, G)
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(build::contract(kid<1>(n), build::rows_transpose(g)), build::contract(kid<0>(n), g));
  }
};
namespace detail {
struct scan_cost {  // one add per state entry and row; the state itself
  template <class S, class X, class Src>
  static constexpr cost_estimate cost(Src const& s, double elem) {
    double ab = ext<typename S::a>(s) * ext<typename S::b>(s);
    return {ext<typename S::rows>(s) * ab, ab * elem, ext<typename S::rows>(s) * ab};
  }
};
}  // namespace detail
template <class D>
struct op_traits<op::prefix_scan_t<D>> : detail::decay_call_notation<"prefix">, detail::scan_cost {
  static constexpr bool differentiable = true;  // prefix(S) -> suffix(G), the same decay
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(build::suffix(g, decay_of(n.op)));
  }
};
template <class D>
struct op_traits<op::suffix_scan_t<D>> : detail::decay_call_notation<"suffix">, detail::scan_cost {
  static constexpr bool differentiable = true;  // suffix(S) -> prefix(G), the same decay
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(build::prefix(g, decay_of(n.op)));
  }
};
template <>
struct op_traits<op::transpose_rows> : detail::call_notation<"rowsᵀ">, detail::free_cost {
  static constexpr bool differentiable = true;  // rowsᵀ(S) -> rowsᵀ(G)
  template <class N, class G>
  static constexpr auto adjoint(N const&, G const& g) {
    return hana::make_tuple(build::rows_transpose(g));
  }
};
template <>
struct op_traits<op::contract_rows> : detail::call_notation<"contract"> {
  template <class S, class A, class Seq, class Src>  // out_i = A_iᵀ S_i: a x b multiply-adds per row
  static constexpr cost_estimate cost(Src const& s, double elem) {
    double r = detail::ext<typename S::rows>(s), a = detail::ext<typename Seq::a>(s), b = detail::ext<typename Seq::b>(s);
    return {2 * r * a * b, r * b * elem, 2 * r * a * b};
  }
  static constexpr bool differentiable = true;  // contract(A, S) -> contract(G, rowsᵀ(S)), A⊗G
  template <class N, class G>
  static constexpr auto adjoint(N const& n, G const& g) {
    return hana::make_tuple(build::contract(g, build::rows_transpose(kid<1>(n))), build::outer(kid<0>(n), g));
  }
};
template <class Key, std::size_t Threshold>
struct op_traits<op::select<Key, Threshold>> : detail::named<"select"> {  // cost: the branch taken (cost.hpp)
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.text(fmt::format("({} < {} ? ", Key::label(), Threshold));
    p(kid<0>(n));
    p.text(" : ");
    p(kid<1>(n));
    p.text(")");
  }
};

// ---- backward vocabulary (no adjoints: not differentiated again) ----------------------
template <class Map>
struct op_traits<op::phi_vjp<Map>> : detail::named<"phi_vjp", prec::product>, detail::elementwise_cost {
  template <class N, class P>
  static void print(N const& n, P& p) {
    if constexpr (concepts::elementwise_map<Map>) {  // φ′[elu+1](X)⊙G
      p.text("φ′");
      p.text(detail::map_tag<Map>());
      p.text("(");
      p(kid<0>(n));
      p.text(")⊙");
      p(kid<1>(n), prec::atom);
    } else {
      p.call(fmt::format("φ_vjp{}", detail::map_tag<Map>()), n);
    }
  }
};
template <class Map>
struct op_traits<op::phi_param_vjp<Map>> : detail::named<"phi_param_vjp">, detail::elementwise_cost {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(fmt::format("φ_w′{}", detail::map_tag<Map>()), n);
  }
};
template <class Map>
struct op_traits<op::phi_grad_z<Map>> : detail::named<"phi_grad_z">, detail::elementwise_cost {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(fmt::format("φ_z′{}", detail::map_tag<Map>()), n);
  }
};
template <class Map>
struct op_traits<op::phi_dx<Map>> : detail::named<"phi_dx"> {
  template <class N, class P>
  static void print(N const& n, P& p) {
    p.call(fmt::format("φ_dx{}", detail::map_tag<Map>()), n);
  }
  // H·Wᵀ, then a pass over the rows
  template <class S, class X, class W, class H, class Src>
  static constexpr cost_estimate cost(Src const& s, double elem) {
    double n = detail::elements<S>(s);
    return {2 * detail::ext<typename S::rows>(s) * detail::ext<typename S::cols>(s) * detail::ext<typename W::cols>(s) + n,
            n * elem};
  }
};
template <>
struct op_traits<op::normalize_vjp> : detail::eps_call_notation<"normalize′">, detail::elementwise_cost {};
template <>
struct op_traits<op::row_divide_vjp> : detail::eps_call_notation<"rowdiv′">, detail::elementwise_cost {};
template <>
struct op_traits<op::hadamard> : detail::infix_notation<"hadamard", "⊙">, detail::elementwise_cost {};
template <>
struct op_traits<op::add> : detail::infix_notation<"add", " + ", prec::sum>, detail::elementwise_cost {};
template <>
struct op_traits<op::drop_last> : detail::call_notation<"dropcol">, detail::free_cost {};
template <>
struct op_traits<op::bundle> : detail::call_notation<"bundle">, detail::elementwise_cost {};

}  // namespace lina
