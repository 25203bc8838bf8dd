// fmt formatters for expressions and plans: fmt::print("{}", compile(e)).
//
//   normalize(causal(φ(Q)·φ(K)ᵀ))·V                        an expression
//   rowdiv((N < 23 ? causal(φ(Q)·φ(K)ᵀ)·[V|1]
//                  : contract(φ(Q), prefix(φ(K)⊗[V|1]))))  its plan
//
// Plan notation (docs/architecture.md): [X|1] appends a ones column; rowdiv
// divides each row by its last column and drops it; A⊗B is the sequence of
// per-row outer products A_j B_jᵀ; prefix/suffix are running sums over rows;
// contract(A, S) is the row contraction out_i = A_iᵀ S_i; (N < t ? a : b) is
// the run-time choice on the sequence length.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/feature_maps.hpp"
#include "lina/node.hpp"

namespace lina {
namespace detail {

enum class prec { sum = 1, product = 2, atom = 3 };

// Names given to repeated subtrees when a backward plan is printed; null
// when printing plainly.
struct print_names {
  std::vector<std::pair<std::string, std::string>> named;  // (plain form, name)
  std::string const* find(std::string const& plain) const {
    for (auto const& [p, n] : named)
      if (p == plain) return &n;
    return nullptr;
  }
};
inline thread_local print_names const* active_names = nullptr;

template <class N>
constexpr prec precedence() {
  using Op = typename N::op_type;
  if constexpr (std::is_same_v<Op, op::add>)
    return prec::sum;
  else if constexpr (std::is_same_v<Op, op::product> || std::is_same_v<Op, op::scale> ||
                     std::is_same_v<Op, op::outer_rows> || std::is_same_v<Op, op::hadamard> ||
                     requires { typename Op::vjp_of; })
    return prec::product;
  else
    return prec::atom;
}

template <class N>
void print(N const& n, std::string& out);

// Print a kid, in parentheses if it binds looser than `at_least`.
template <class K>
void print_kid(K const& k, std::string& out, prec at_least) {
  bool paren = precedence<K>() < at_least;
  if (paren) out += '(';
  print(k, out);
  if (paren) out += ')';
}

template <class N>
void print_call(std::string_view name, N const& n, std::string& out) {
  out += name;
  out += '(';
  bool first = true;
  hana::unpack(n.kids, [&](auto const&... k) {
    ((out += first ? "" : ", ", first = false, print(k, out)), ...);
  });
  out += ')';
}

template <class N>
void print_node(N const& n, std::string& out);

template <class N>
void print(N const& n, std::string& out) {
  if (active_names) {  // a named subtree prints as its name
    print_names const* names = std::exchange(active_names, nullptr);
    std::string plain;
    print_node(n, plain);
    active_names = names;
    if (auto const* name = names->find(plain)) {
      out += *name;
      return;
    }
  }
  print_node(n, out);
}

template <class N>
void print_node(N const& n, std::string& out) {
  using Op = typename N::op_type;
  if constexpr (is_input_op_v<Op>) {
    out += Op::name.view();
  } else if constexpr (requires { typename Op::map; }) {  // phi, phi(X; W)
    out += "φ(";
    print(kid<0>(n), out);
    if constexpr (N::arity == 2) {
      out += "; ";
      print(kid<1>(n), out);
    }
    out += ')';
  } else if constexpr (requires { typename Op::param_vjp_of; }) {
    print_call("φ_w′", n, out);
  } else if constexpr (requires { typename Op::vjp_of; }) {  // phi_vjp
    if constexpr (concepts::elementwise_map<typename Op::vjp_of>) {
      out += "φ′(";
      print(kid<0>(n), out);
      out += ")⊙";
      print_kid(kid<1>(n), out, prec::atom);
    } else {
      print_call("φ_vjp", n, out);
    }
  } else if constexpr (std::is_same_v<Op, op::hadamard>) {
    print_kid(kid<0>(n), out, prec::atom);
    out += "⊙";
    print_kid(kid<1>(n), out, prec::atom);
  } else if constexpr (std::is_same_v<Op, op::add>) {
    print_kid(kid<0>(n), out, prec::sum);
    out += " + ";
    print_kid(kid<1>(n), out, prec::product);
  } else if constexpr (std::is_same_v<Op, op::drop_last>) {
    print_call("dropcol", n, out);
  } else if constexpr (std::is_same_v<Op, op::row_divide_vjp>) {
    print_call("rowdiv′", n, out);
  } else if constexpr (std::is_same_v<Op, op::normalize_vjp>) {
    print_call("normalize′", n, out);
  } else if constexpr (std::is_same_v<Op, op::bundle>) {
    print_call("bundle", n, out);
  } else if constexpr (std::is_same_v<Op, op::transpose>) {
    print_kid(kid<0>(n), out, prec::atom);
    out += "ᵀ";
  } else if constexpr (std::is_same_v<Op, op::product>) {
    // a product kid of a product keeps its parentheses: the bracketing is the order
    print_kid(kid<0>(n), out, prec::atom);
    out += "·";
    print_kid(kid<1>(n), out, prec::atom);
  } else if constexpr (std::is_same_v<Op, op::scale>) {
    out += fmt::format("{:g}·", n.op.factor);
    print_kid(kid<0>(n), out, prec::atom);
  } else if constexpr (std::is_same_v<Op, op::outer_rows>) {
    print_kid(kid<0>(n), out, prec::atom);
    out += "⊗";
    print_kid(kid<1>(n), out, prec::atom);
  } else if constexpr (std::is_same_v<Op, op::append_ones>) {
    out += '[';
    print(kid<0>(n), out);
    out += "|1]";
  } else if constexpr (is_select_op<Op>) {
    out += fmt::format("({} < {} ? ", Op::key::label(), Op::threshold);
    print(kid<0>(n), out);
    out += " : ";
    print(kid<1>(n), out);
    out += ')';
  } else if constexpr (std::is_same_v<Op, op::causal>) {
    print_call("causal", n, out);
  } else if constexpr (std::is_same_v<Op, op::normalize>) {
    print_call("normalize", n, out);
  } else if constexpr (std::is_same_v<Op, op::exp>) {
    print_call("exp", n, out);
  } else if constexpr (std::is_same_v<Op, op::chain>) {
    print_call("chain", n, out);
  } else if constexpr (std::is_same_v<Op, op::row_divide>) {
    print_call("rowdiv", n, out);
  } else if constexpr (std::is_same_v<Op, op::prefix_scan>) {
    print_call("prefix", n, out);
  } else if constexpr (std::is_same_v<Op, op::suffix_scan>) {
    print_call("suffix", n, out);
  } else if constexpr (std::is_same_v<Op, op::transpose_rows>) {
    print_call("rowsᵀ", n, out);
  } else if constexpr (std::is_same_v<Op, op::contract_rows>) {
    print_call("contract", n, out);
  } else {
    static_assert(detail::always_false<Op>, "lina: no printed form for this op");
  }
}

}  // namespace detail

// The printed form of an expression or plan.
template <class N>
  requires is_node<N>
std::string to_string(N const& n) {
  std::string s;
  auto const* names = std::exchange(detail::active_names, nullptr);
  detail::print(n, s);
  detail::active_names = names;
  return s;
}

}  // namespace lina

template <class Op, class... K>
struct fmt::formatter<lina::node<Op, K...>> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(lina::node<Op, K...> const& n, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(lina::to_string(n), ctx);
  }
};
