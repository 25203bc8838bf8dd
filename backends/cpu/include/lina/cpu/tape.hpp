// Training without recomputing the forward: cpu::tape.
//
//   cpu::tape<float> tp;
//   auto out = cpu::evaluate(plan, tp, Q = q, K = k, V = v);          // keeps what the backward reads
//   auto g = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v);      // reads it instead of recomputing
//
// The forward runs bundle(plan, plan, values…) of save_for_backward (one
// schedule: the output and the kept values, each written once); the backward
// runs the saved form of the derived plan with saved_i bound to the tape's
// tensor i. For the causal linear plan that is Y, N x (M+1) per slice (as
// much as the output), and the backward skips the recomputed forward scan.
// The gradients are those of cpu::gradient (the same operations on the same
// values). The tape keeps its tensors from call to call (a training loop
// reuses memory already faulted in) until clear().
//
// The backward must be given the inputs its forward read: a tape does not
// hold them, and cannot tell a changed tensor from the one it saw. A tape of
// another plan (or of this plan at extents whose order differs), or one no
// forward filled, is a lina::tape_error; one of other extents a
// lina::shape_error on its saved value.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "lina/cpu/evaluate.hpp"
#include "lina/cpu/gradient.hpp"
#include "lina/saved.hpp"

namespace lina::cpu {

namespace detail {
struct tape_access;
}

template <class T>
class tape {
 public:
  tape() = default;
  // Filled by a forward (and not cleared since).
  bool filled() const noexcept { return plan_type_ != nullptr; }
  // The values kept, each a [B, H, rows, cols] tensor (saved1 is value(0)).
  std::size_t size() const noexcept { return values_.size(); }
  tensor<T> const& value(std::size_t i) const { return values_.at(i); }
  std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (auto const& v : values_) n += v.size() * sizeof(T);
    return n;
  }
  // The plan whose forward filled it, as text ("" when none did).
  std::string plan() const { return plan_ ? print_(plan_.get()) : std::string(); }
  // Forget the values and free their memory.
  void clear() {
    *this = tape{};
  }

 private:
  friend struct detail::tape_access;
  std::type_info const* plan_type_ = nullptr;  // the select-free plan that ran
  std::shared_ptr<void const> plan_;           // a copy of it: its values (eps, decays) must match too
  std::string (*print_)(void const*) = nullptr;  // to_string of that copy (for errors: not made each call)
  bool recompute_ = false;  // its saved form was not exact: nothing kept, the backward recomputes
  std::vector<tensor<T>> values_;
};

namespace detail {
struct tape_access {
  // The forward of select-free plan p into out, keeping its values in tp.
  template <class T, class P, class Bound>
  static void forward(P const& p, Bound const& in, tensor_view<T> out, tape<T>& tp) {
    auto const sv = save_for_backward(p);
    tp.plan_type_ = nullptr;  // (filled again only once the run has finished)
    if (!sv.exact) {
      tp.values_.clear();
      run_slices<T>(p, in, std::array{out});
    } else {
      constexpr std::size_t k = std::remove_cvref_t<decltype(sv)>::size;
      tp.values_.resize(k);
      std::array<tensor_view<T>, k + 1> outs{out};
      std::size_t i = 0;
      hana::for_each(sv.values, [&](auto const& x) {
        shape4 want = result_shape<std::remove_cvref_t<decltype(x)>>(in);
        if (tp.values_[i].shape() != want) tp.values_[i] = tensor<T>(want);
        outs[i + 1] = tp.values_[i].view();
        ++i;
      });
      auto const fb = hana::unpack(sv.values, [&](auto const&... x) { return make_node(op::bundle{}, p, p, x...); });
      run_slices<T>(fb, in, outs);
    }
    tp.plan_type_ = &typeid(P);
    tp.plan_ = std::make_shared<P const>(p);
    tp.print_ = [](void const* q) { return to_string(*static_cast<P const*>(q)); };
    tp.recompute_ = !sv.exact;
  }

  // The backward of select-free plan p into `into` (views by the inputs of the
  // whole plan), reading tp's values.
  template <class T, class P, class Into, class D, class... B>
  static void backward(P const& p, Into& into, tape<T> const& tp, D const& dout, B const&... bindings) {
    if (!tp.filled())
      throw tape_error("this tape holds no forward's values: run cpu::evaluate(plan, tape, …) first");
    if (*tp.plan_type_ != typeid(P) || !same_value(*static_cast<P const*>(tp.plan_.get()), p))
      throw tape_error("this tape holds the values of the plan " + tp.plan() + ", not of " + to_string(p) +
                       " (another plan, or this one at extents where it runs another order)");
    auto const sv = save_for_backward(p);
    using SV = std::remove_cvref_t<decltype(sv)>;
    auto run = [&](auto const& bp, auto const&... saved) {
      using BP = std::remove_cvref_t<decltype(bp)>;
      auto dview = view_of(dout);
      auto in = bind<decltype(as_bundle(bp))>(bindings..., binding<cotangent_symbol, decltype(dview)>{dview}, saved...);
      gradients_of<tensor_view<T>, BP> mine;  // into's views in the order of p's inputs
      [&]<class Fw, class... E>(backward_plan<Fw, E...> const*) {
        std::size_t i = 0;
        ((mine.all()[i++] = into[node<typename E::input>{}]), ...);
      }(static_cast<BP const*>(nullptr));
      auto outs = checked_gradient_views<BP>(in, mine);
      run_slices<T>(as_bundle(bp), in, outs);
    };
    if (tp.recompute_) {
      if constexpr (!value_free<P>()) run(gradient(p));  // (an exact saved form has nothing to recompute)
      return;
    }
    if (tp.values_.size() != SV::size)
      throw tape_error("this tape holds " + std::to_string(tp.values_.size()) + " values, the plan's backward reads " +
                       std::to_string(SV::size));
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      run(sv.backward, make_binding<lina::detail::saved_name<I + 1>()>(tp.values_[I])...);
    }(std::make_index_sequence<SV::size>{});
  }
};
}  // namespace detail

// evaluate(plan, tape, Q = q, …) -> the output, keeping in `tape` what the
// backward reads (reusing its memory when the extents repeat).
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
void evaluate_into(Plan const& plan, tensor_view<T> out, tape<T>& tp, B const&... bindings) {
  auto in = bind<Plan>(bindings...);
  static_assert(std::is_same_v<typename decltype(in)::value_type, T>,
                "lina::cpu::evaluate (tape): the tape, the output and the inputs must have one element type");
  check_result_shape<Plan>(out.shape(), in);
  with_resolved_plan(plan, in.table, [&](auto const& p) { detail::tape_access::forward<T>(p, in, out, tp); });
}
template <class Plan, class T, class... B>
  requires(is_node<Plan> && (is_binding<B> && ...))
auto evaluate(Plan const& plan, tape<T>& tp, B const&... bindings) {
  tensor<T> out(result_shape<Plan>(bind<Plan>(bindings...)));
  evaluate_into(plan, out.view(), tp, bindings...);
  return out;
}

// gradient_into(plan, into, tape, dout, Q = q, …): cpu::gradient_into's
// gradients, from the values the tape's forward kept.
template <class P, class T, class... In, class D, class... B>
  requires(is_node<P> && (is_binding<B> && ...))
void gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, tape<T> const& tp, D const& dout,
                   B const&... bindings) {
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_for<tensor_view<T>, P>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  static_assert(std::is_same_v<std::remove_const_t<typename decltype(view_of(dout))::element_type_>, T>,
                "lina::cpu::gradient_into: the gradient views, the tape and dout must have one element type");
  auto in = bind<P>(bindings...);
  with_resolved_plan(plan, in.table, [&](auto const& p) { detail::tape_access::backward<T>(p, into, tp, dout, bindings...); });
}
// gradient(plan, tape, dout, Q = q, …) -> gradients: g[Q], g[K], …, each laid out like its input.
template <class P, class T, class D, class... B>
  requires(is_node<P> && (is_binding<B> && ...))
auto gradient(P const& plan, tape<T> const& tp, D const& dout, B const&... bindings) {
  auto in = bind<P>(bindings...);
  gradients_for<tensor<T>, P> g;
  gradients_for<tensor_view<T>, P> into;
  for (std::size_t i = 0; i < g.all().size(); ++i) {
    g.all()[i] = tensor<T>::like(in.views[i]);
    into.all()[i] = g.all()[i].view();
  }
  gradient_into(plan, into, tp, dout, bindings...);
  return g;
}

}  // namespace lina::cpu
