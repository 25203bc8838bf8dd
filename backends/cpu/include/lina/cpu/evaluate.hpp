// Evaluating an expression or a plan on the CPU.
//
// Each node is lowered by lower<Op> (the backend's dispatch table, one
// specialisation per operation tag, as Eigen's evaluators); a node with no
// lowering is a compile error naming it. Per-row matrix sequences are never
// materialised: contract(A, prefix(B⊗C)) and its suffix form lower together
// to one fused scan whose a x b state stays in cache. Batch x heads run in
// parallel with OpenMP; each (batch, head) slice evaluates the tree into
// per-slice temporaries.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "lina/cpu/bind.hpp"
#include "lina/cpu/kernels.hpp"
#include "lina/cpu/matrix.hpp"
#include "lina/cpu/state.hpp"
#include "lina/node.hpp"
#include "lina/tensor.hpp"

namespace lina::cpu {

// One (batch, head) slice of an evaluation. Node types listed in Shared are
// evaluated once per slice and reused (the subtrees a backward plan's
// gradients have in common, e.g. the recomputed forward pass).
template <class Bound, class Shared = lina::detail::type_list<>>
struct slice {
  using T = typename Bound::value_type;
  Bound const& in;
  std::size_t b, h;
  state<T>* st = nullptr;  // the running sums prefix scans start from and end with
  mutable std::size_t next_scan = 0;  // prefix scans are numbered in evaluation order

  struct cached {
    void const* node;  // of a type in Shared, compared with same_value
    std::size_t type;  // index of that type in Shared
    matrix<T> value;
  };
  mutable std::vector<cached> cache{};

  template <class N>
  static constexpr std::size_t shared_index() {
    return lina::detail::index_of_v<N, Shared>;
  }
  template <class N>
  static constexpr bool shares() {
    return shared_index<N>() < Shared::size;
  }
};

template <class T>
matrix<T> alias(matrix<T> const& m) {  // a view of m's elements, not owning them
  return view(m.data, m.rows, m.cols, m.rs, m.cs);
}

template <class Op>
struct lower {
  static_assert(lina::detail::always_false<Op>,
                "lina::cpu cannot lower this node on its own (its op is in the instantiation of lower<> above); "
                "per-row sequences (⊗, prefix, suffix) lower only as contract(A, prefix(B⊗C)) or "
                "contract(A, suffix(B⊗C))");
};

template <class T, class N, class Ctx>
matrix<T> eval(N const& n, Ctx const& ctx) {
  if constexpr (Ctx::template shares<N>()) {
    constexpr std::size_t type = Ctx::template shared_index<N>();
    for (auto const& c : ctx.cache)
      if (c.type == type && same_value(*static_cast<N const*>(c.node), n)) return alias(c.value);
    ctx.cache.push_back({&n, type, lower<typename N::op_type>::template run<T>(n, ctx)});
    return alias(ctx.cache.back().value);  // buffers do not move when the cache grows
  } else {
    return lower<typename N::op_type>::template run<T>(n, ctx);
  }
}

template <fixed_string Name, class R, class C>
struct lower<op::input<Name, R, C>> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const&, Ctx const& ctx) {
    auto const& v = ctx.in.views[std::remove_cvref_t<decltype(ctx.in)>::template input_index<op::input<Name, R, C>>()];
    auto const& s = v.strides();
    T const* base = v.data() + static_cast<index>(ctx.b) * s[0] + static_cast<index>(ctx.h) * s[1];
    return view(base, static_cast<index>(v.shape()[2]), static_cast<index>(v.shape()[3]), s[2], s[3]);
  }
};

template <class Map>
struct lower<op::phi<Map>> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    if constexpr (N::arity == 2) {  // a parametric map reads its projection W
      matrix<T> x = eval<T>(kid<0>(n), ctx);
      return kernels::feature_map<Map>(x, eval<T>(kid<1>(n), ctx));
    } else {
      return kernels::feature_map<Map>(eval<T>(kid<0>(n), ctx));
    }
  }
};

template <>
struct lower<op::transpose> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    return eval<T>(kid<0>(n), ctx).transposed();
  }
};

template <>
struct lower<op::product> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> a = eval<T>(kid<0>(n), ctx);
    return kernels::gemm(a, eval<T>(kid<1>(n), ctx));
  }
};

template <>
struct lower<op::causal> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> m = writable(eval<T>(kid<0>(n), ctx));
    kernels::causal_mask(m);
    return m;
  }
};

template <>
struct lower<op::normalize> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> m = writable(eval<T>(kid<0>(n), ctx));
    kernels::normalize_rows(m, static_cast<T>(n.op.eps));
    return m;
  }
};

template <>
struct lower<op::scale> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> m = writable(eval<T>(kid<0>(n), ctx));
    T s = static_cast<T>(n.op.factor);
    kernels::apply_inplace(m, [s](T x) { return s * x; });
    return m;
  }
};

template <>
struct lower<op::exp> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> m = writable(eval<T>(kid<0>(n), ctx));
    kernels::apply_inplace(m, [](T x) { return std::exp(x); });
    return m;
  }
};

template <>
struct lower<op::append_ones> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    return kernels::append_ones(eval<T>(kid<0>(n), ctx));
  }
};

template <>
struct lower<op::row_divide> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    return kernels::row_divide(eval<T>(kid<0>(n), ctx), static_cast<T>(n.op.eps));
  }
};

template <class K, std::size_t Threshold>
struct lower<op::select<K, Threshold>> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    if (ctx.in.table.template get<K>() < Threshold) return eval<T>(kid<0>(n), ctx);
    return eval<T>(kid<1>(n), ctx);
  }
};

// ---- backward ops ----
template <class Map>
struct lower<op::phi_vjp<Map>> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> x = eval<T>(kid<0>(n), ctx);
    if constexpr (N::arity == 3) {
      matrix<T> w = eval<T>(kid<1>(n), ctx);
      return kernels::feature_map_vjp<Map, false>(x, w, eval<T>(kid<2>(n), ctx));
    } else {
      return kernels::feature_map_vjp<Map>(x, eval<T>(kid<1>(n), ctx));
    }
  }
};

template <class Map>
struct lower<op::phi_param_vjp<Map>> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> x = eval<T>(kid<0>(n), ctx);
    matrix<T> w = eval<T>(kid<1>(n), ctx);
    return kernels::feature_map_vjp<Map, true>(x, w, eval<T>(kid<2>(n), ctx));
  }
};

template <>
struct lower<op::normalize_vjp> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> s = eval<T>(kid<0>(n), ctx);
    return kernels::normalize_vjp(s, eval<T>(kid<1>(n), ctx), static_cast<T>(n.op.eps));
  }
};

template <>
struct lower<op::row_divide_vjp> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> y = eval<T>(kid<0>(n), ctx);
    return kernels::row_divide_vjp(y, eval<T>(kid<1>(n), ctx), static_cast<T>(n.op.eps));
  }
};

template <>
struct lower<op::hadamard> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> a = writable(eval<T>(kid<0>(n), ctx));
    kernels::combine_inplace(a, eval<T>(kid<1>(n), ctx), [](T x, T y) { return x * y; });
    return a;
  }
};

template <>
struct lower<op::add> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> a = writable(eval<T>(kid<0>(n), ctx));
    kernels::combine_inplace(a, eval<T>(kid<1>(n), ctx), [](T x, T y) { return x + y; });
    return a;
  }
};

template <>
struct lower<op::drop_last> {  // a view of the same elements
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    matrix<T> m = eval<T>(kid<0>(n), ctx);
    m.cols -= 1;
    return m;
  }
};

namespace detail {
template <class S>
struct fused_scan : std::false_type {};
template <class B, class C>
struct fused_scan<node<op::prefix_scan, node<op::outer_rows, B, C>>> : std::true_type {
  static constexpr bool reverse = false;
};
template <class B, class C>
struct fused_scan<node<op::suffix_scan, node<op::outer_rows, B, C>>> : std::true_type {
  static constexpr bool reverse = true;
};
}  // namespace detail

// contract(A, prefix(B⊗C)): out_i = A_i^T sum_{j<=i} B_j C_j^T in one pass.
template <>
struct lower<op::contract_rows> {
  template <class T, class N, class Ctx>
  static matrix<T> run(N const& n, Ctx const& ctx) {
    using S = std::remove_cvref_t<decltype(kid<1>(n))>;
    static_assert(detail::fused_scan<S>::value,
                  "lina::cpu: contract(A, S) lowers only when S is prefix(B⊗C) or suffix(B⊗C)");
    constexpr bool reverse = detail::fused_scan<S>::reverse;
    std::size_t k = reverse ? 0 : ctx.next_scan++;  // numbered before the kids, in preorder
    auto const& outer = kid<0>(kid<1>(n));
    matrix<T> a = eval<T>(kid<0>(n), ctx);
    matrix<T> b = eval<T>(kid<0>(outer), ctx);
    matrix<T> c = eval<T>(kid<1>(outer), ctx);
    matrix<T> out = allocate<T>(b.rows, c.cols);
    buffer<T> local;
    T* sums = nullptr;
    if (!reverse && ctx.st) {
      sums = ctx.st->at(k, ctx.b, ctx.h);  // carried across evaluations
    } else {
      local = buffer<T>(static_cast<std::size_t>(b.cols * c.cols));
      std::fill_n(local.get(), local.size(), T(0));
      sums = local.get();
    }
    kernels::scan_contract(a, b, std::move(c), out, sums, reverse);
    return out;
  }
};

// Threads pay off from a few slices of some size; below that, starting them
// costs more than the work (and oversubscribed machines make it worse).
inline constexpr std::size_t parallel_min_elements = std::size_t(1) << 15;
template <class Bound>
bool worth_threads(Bound const& in) {
  std::size_t elements = 0;
  for (auto const& v : in.views) elements += v.shape()[0] * v.shape()[1] * v.shape()[2] * v.shape()[3];
  return in.batch * in.heads > 1 && elements >= parallel_min_elements;
}

namespace detail {
// Write one slice's result into [b, h] of an output of any layout.
template <class T>
void store(matrix<T> const& m, tensor_view<T> out, std::size_t b, std::size_t h) {
  for (index i = 0; i < m.rows; ++i)
    for (index j = 0; j < m.cols; ++j) out(b, h, static_cast<std::size_t>(i), static_cast<std::size_t>(j)) = m(i, j);
}

template <class T, class Plan, class Bound>
void evaluate_slices(Plan const& plan, Bound const& in, tensor_view<T> out, state<T>* st = nullptr) {
  long total = static_cast<long>(in.batch * in.heads);
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(in))
  for (long bh = 0; bh < total; ++bh) {
    slice<Bound> ctx{in, static_cast<std::size_t>(bh) / in.heads, static_cast<std::size_t>(bh) % in.heads, st};
    store(eval<T>(plan, ctx), out, ctx.b, ctx.h);
  }
}
template <class Plan, class Bound>
shape4 result_shape(Bound const& in) {
  using S = typename Plan::shape;
  return {in.batch, in.heads, static_cast<std::size_t>(S::rows::extent(in.table)),
          static_cast<std::size_t>(S::cols::extent(in.table))};
}
}  // namespace detail

// evaluate(plan, Q = q, K = k, V = v) -> [B, H, rows, cols] (an expression
// evaluates as written, which makes it the oracle of its compiled plans).
template <class Plan, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  using T = typename decltype(in.views)::value_type::element_type_;
  tensor<T> out(detail::result_shape<Plan>(in));
  detail::evaluate_slices<T>(plan, in, out.view());
  return out;
}

// Like evaluate, into caller memory of any layout (e.g. a [B,N,H,M] view).
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  shape4 want = detail::result_shape<Plan>(in);
  static constexpr char const* names[] = {"B (batch)", "H (heads)", "rows", "cols"};
  for (int d = 0; d < 4; ++d)
    if (out.shape()[d] != want[d]) throw shape_error("out", names[d], out.shape()[d], want[d], "of the plan's result");
  detail::evaluate_slices<T>(plan, in, out);
}

}  // namespace lina::cpu
