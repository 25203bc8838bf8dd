// fmt formatters for expressions and plans: fmt::print("{}", compile(e)).
//
//   normalize(causal(φ[elu+1](Q)·φ[elu+1](K)ᵀ))·V                       an expression
//   rowdiv((N < 23 ? causal(φ[elu+1](Q)·φ[elu+1](K)ᵀ)·[V|1]
//                  : contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1]))))  its plan
//
// Plan notation (docs/architecture.md): [X|1] appends a ones column; rowdiv
// divides each row by its last column and drops it; A⊗B is the sequence of
// per-row outer products A_j B_jᵀ; prefix/suffix are running sums over rows;
// contract(A, S) is the row contraction out_i = A_iᵀ S_i; (N < t ? a : b) is
// the run-time choice on the sequence length. Each op's notation is in its
// op_traits (op_traits.hpp); values print exactly (scale factors, an eps that
// is not the default).
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "lina/node.hpp"
#include "lina/op_traits.hpp"

namespace lina {
namespace detail {

// Subtrees to print as a name (a backward plan's shared subtrees), keyed by
// identity: the same node type with the same values, never by printed text.
// A subtree's identity: its type and, compared with same_value, its values.
// Looked up by type_info and address, so that printing a tree makes no
// function per node type for its name look-ups.
struct node_identity {
  std::type_info const* type = nullptr;
  void const* node = nullptr;
  bool (*same)(void const*, void const*) = nullptr;

  template <class N>
  static bool same_as(void const* a, void const* b) {
    return same_value(*static_cast<N const*>(a), *static_cast<N const*>(b));
  }
  template <class N>
  static node_identity of(N const& n) {
    return {&typeid(N), &n, &same_as<N>};
  }
  // Whether the node at n, of type t, is this one.
  bool is(std::type_info const& t, void const* n) const { return *type == t && same(node, n); }
};

struct print_names {
  struct entry {
    node_identity id;
    std::string name;
  };
  std::vector<entry> named;

  std::string const* find(std::type_info const& t, void const* n) const {
    for (auto const& e : named)
      if (e.id.is(t, n)) return &e.name;
    return nullptr;
  }
};

template <class N>
constexpr prec precedence() {
  return op_traits<typename N::op_type>::precedence;
}

// Writes nodes through their op_traits; with `names`, a named subtree prints
// as its name. No global state: printing is re-entrant and exception-safe.
struct printer {
  std::string out;
  print_names const* names = nullptr;

  // n (a kid: in parentheses if it binds looser than `at_least`), or its name.
  template <class N>
  void operator()(N const& n, prec at_least = prec::sum) {
    if (names)
      if (std::string const* name = names->find(typeid(N), &n)) {
        out += *name;
        return;
      }
    bool const paren = precedence<N>() < at_least;
    if (paren) out += '(';
    node(n);
    if (paren) out += ')';
  }
  // n's own notation, its kids through operator() (a definition's top line).
  template <class N>
  void node(N const& n) {
    using Traits = op_traits<typename N::op_type>;
    static_assert(requires { Traits::precedence; }, "lina: this op has no op_traits (no printed form)");
    Traits::print(n, *this);
  }
  // name(kid, kid, …suffix)
  template <class N>
  void call(std::string_view name, N const& n, std::string_view suffix = {}) {
    out += name;
    out += '(';
    kids(n, std::make_index_sequence<N::arity>{});
    out += suffix;
    out += ')';
  }
  void text(std::string_view s) { out += s; }

 private:
  template <class N, std::size_t... I>
  void kids(N const& n, std::index_sequence<I...>) {
    ((out += I ? ", " : "", (*this)(kid<I>(n))), ...);
  }
};

}  // namespace detail

// The printed form of an expression or plan.
template <class N>
  requires is_node<N>
std::string to_string(N const& n) {
  detail::printer p;
  p(n);
  return std::move(p.out);
}

}  // namespace lina

template <class Op, class... K>
struct fmt::formatter<lina::node<Op, K...>> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(lina::node<Op, K...> const& n, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(lina::to_string(n), ctx);
  }
};
