// The CPU backward: cpu::gradient(plan, dout, Q = q, K = k, V = v).
//
// Derives the backward plan (lina::gradient) at compile time, binds the
// inputs and dout (dout must have the output's shape, else lina::shape_error),
// and evaluates every gradient expression per (batch, head) slice. For a
// linear plan each gradient is a few fused scans over rows, so the extra
// memory is O(N (C + M)) per slice for the matrices it reads (φ(Q), [V|1],
// ...) plus a C x (M+1) state: no N x N, no per-step state cache.
#pragma once

#include <array>
#include <boost/hana/for_each.hpp>
#include <boost/hana/range.hpp>
#include <cstddef>
#include <type_traits>

#include "lina/cpu/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/gradient.hpp"

namespace lina::cpu {

// The gradients of one backward evaluation: g[Q] is ∂L/∂Q, a tensor with the
// shape of Q and the memory layout of the tensor bound to Q.
template <class T, class... In>
class gradients {
 public:
  template <class Op>
  tensor<T> const& operator[](node<Op> const&) const {
    constexpr std::size_t i = lina::detail::index_of_v<Op, lina::detail::type_list<In...>>;
    static_assert(i < sizeof...(In), "lina: this input is not an input of the differentiated plan");
    return tensors_[i];
  }
  template <class Op>
  tensor<T>& operator[](node<Op> const&) {
    constexpr std::size_t i = lina::detail::index_of_v<Op, lina::detail::type_list<In...>>;
    static_assert(i < sizeof...(In), "lina: this input is not an input of the differentiated plan");
    return tensors_[i];
  }
  std::array<tensor<T>, sizeof...(In)>& all() { return tensors_; }

 private:
  std::array<tensor<T>, sizeof...(In)> tensors_;
};

namespace detail {
template <class BP>
constexpr auto as_bundle(BP const& bp) {
  // The forward plan rides along as the first kid so that every input it
  // uses counts as bound, even one no gradient expression reads.
  return hana::unpack(bp.entries, [&](auto const&... e) { return make_node(op::bundle{}, bp.forward, e.expr...); });
}
template <class T, class F, class... E>
auto make_gradients(backward_plan<F, E...> const*) -> gradients<T, typename E::input...>;

template <class List>
struct worth_sharing;
template <class... N>
struct worth_sharing<lina::detail::type_list<N...>> {
  template <class X>
  static constexpr bool worth = X::shape::rank == 2 && !is_input_op_v<typename X::op_type> &&
                                !std::is_same_v<typename X::op_type, op::transpose> &&
                                !std::is_same_v<typename X::op_type, op::drop_last>;
  using type = typename lina::detail::concat_lists<
      std::conditional_t<worth<N>, lina::detail::type_list<N>, lina::detail::type_list<>>...>::type;
};
}  // namespace detail

// gradient(plan or backward_plan, dout, bindings...) -> gradients: g[Q], g[K], ...
template <class P, class D, class... B>
auto gradient(P const& plan, D const& dout, B const&... bindings) {
  auto const bp = [&] {
    if constexpr (is_backward_plan<P>)
      return plan;
    else
      return lina::gradient(plan);
  }();
  using BP = std::remove_cvref_t<decltype(bp)>;
  auto dview = view_of(dout);
  using T = std::remove_const_t<typename decltype(dview)::element_type_>;
  auto all = detail::as_bundle(bp);
  auto in = bind<decltype(all)>(bindings..., binding<cotangent_symbol, T>{dview});

  using result_type = decltype(detail::make_gradients<T>(static_cast<BP const*>(nullptr)));
  result_type g;
  constexpr std::size_t count = decltype(hana::size(bp.entries))::value;
  hana::for_each(hana::make_range(hana::size_c<0>, hana::size_c<count>), [&](auto i) {
    using Entry = std::remove_cvref_t<decltype(hana::at_c<decltype(i)::value>(bp.entries))>;
    constexpr std::size_t k = decltype(in)::template input_index<typename Entry::input>();
    g.all()[i] = tensor<T>::like(in.views[k]);
  });

  // Subtrees the gradients share (the recomputed forward pass, rowdiv′, φ(Q),
  // ...) are evaluated once per slice; inputs and views are not worth it.
  using shared = typename detail::worth_sharing<repeated_nodes<decltype(all)>>::type;
  long total = static_cast<long>(in.batch * in.heads);
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(in))
  for (long bh = 0; bh < total; ++bh) {
    slice<decltype(in), shared> ctx{in, static_cast<std::size_t>(bh) / in.heads, static_cast<std::size_t>(bh) % in.heads, {}};
    hana::for_each(hana::make_range(hana::size_c<0>, hana::size_c<count>), [&](auto i) {
      detail::store(eval<T>(hana::at_c<decltype(i)::value>(bp.entries).expr, ctx), g.all()[i].view(), ctx.b, ctx.h);
    });
  }
  return g;
}

}  // namespace lina::cpu
