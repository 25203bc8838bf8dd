// The CPU backward: cpu::gradient(plan, dout, Q = q, K = k, V = v).
//
// Derives the backward plan (lina::gradient) at compile time, binds the
// inputs and dout (dout must have the output's shape, else lina::shape_error),
// and runs the schedule of bundle(forward, ∂In…) per (batch, head) slice:
// one program computes every gradient, each straight into its result tensor,
// and what the gradients share is computed once. For a linear plan each
// gradient is a few fused scans over rows, so the extra memory is
// O(N (C + M)) per slice for the matrices it reads (φ(Q), [V|1], ...) plus a
// C x (M+1) state: no N x N, no per-step state cache.
#pragma once

#include <algorithm>
#include <array>
#include <boost/hana/for_each.hpp>
#include <boost/hana/range.hpp>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/bind.hpp"
#include "lina/cpu/evaluate.hpp"
#include "lina/gradient.hpp"
#include "lina/saved.hpp"

namespace lina::cpu {

namespace hana = boost::hana;

namespace detail {
// The backward plan's bundle bound to the inputs and dout.
template <class BP, class D, class... B>
auto bind_backward(BP const& bp, D const& dout, B const&... bindings) {
  auto dview = view_of(dout);
  return bind<decltype(as_bundle(bp))>(bindings..., binding<cotangent_symbol, decltype(dview)>{dview});
}
// The type of gradient entry I of backward plan BP.
template <class BP, std::size_t I>
using entry_of = std::remove_cvref_t<decltype(hana::at_c<I>(std::declval<BP const&>().entries))>;
// Position in the bound inputs of the input gradient i is of.
template <class BP, class Bound, std::size_t I>
constexpr std::size_t gradient_input_index() {
  return Bound::template input_index<typename entry_of<BP, I>::input>();
}
template <class BP>
inline constexpr std::size_t gradient_count = decltype(hana::size(std::declval<BP const&>().entries))::value;

// New gradient tensors, each laid out like its input, and views of them.
template <class T, class BP, class Bound>
auto new_gradients(Bound const& in, std::array<tensor_view<T>, gradient_count<BP>>& outs) {
  gradients_of<tensor<T>, BP> g;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((g.all()[I] = tensor<T>::like(in.views[gradient_input_index<BP, Bound, I>()], uninitialized), outs[I] = g.all()[I].view()), ...);
  }(std::make_index_sequence<gradient_count<BP>>{});
  return g;
}
// New gradient tensors of plan's inputs, each laid out like its input, and
// `into` views of them (for the allocating forms that write through gradient_into).
template <class P, class D, class... B>
auto new_gradients_into(P const& plan, D const& dout, B const&... bindings) {
  using BP = std::remove_cvref_t<decltype(backward_of(plan))>;
  auto in = bind_backward(backward_of(plan), dout, bindings...);
  using T = typename decltype(in)::value_type;
  std::array<tensor_view<T>, gradient_count<BP>> outs;
  auto g = new_gradients<T, BP>(in, outs);
  gradients_of<tensor_view<T>, BP> into;
  for (std::size_t i = 0; i < outs.size(); ++i) into.all()[i] = outs[i];
  return std::pair{std::move(g), into};
}
// The caller's gradient views, each checked against the shape of its input.
template <class BP, class Bound, class T, class... In>
auto checked_gradient_views(Bound const& in, gradients<tensor_view<T>, In...>& into) {
  std::array<tensor_view<T>, gradient_count<BP>> outs;
  std::array<std::string, gradient_count<BP>> names;  // ∂Q, ...
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto one = [&]<std::size_t K>(std::size_t i) {
      auto const& want = in.views[K].shape();
      auto const& got = into.all()[i].shape();
      using Input = lina::detail::type_at_t<K, typename Bound::inputs>;
      names[i] = "∂" + std::string(Input::name.view());
      static constexpr char const* dims[4] = {"B (batch)", "H (heads)", "rows", "cols"};
      for (std::size_t d = 0; d < 4; ++d)
        if (got[d] != want[d])
          throw shape_error(names[i], dims[d], got[d], want[d], "of input " + std::string(Input::name.view()));
      outs[i] = into.all()[i];
    };
    (one.template operator()<gradient_input_index<BP, Bound, I>()>(I), ...);
  }(std::make_index_sequence<gradient_count<BP>>{});
  // (A view may share memory with an input, dout included: run_slices goes
  // through a copy. Two gradients cannot: one would overwrite the other.)
  for (std::size_t i = 0; i < outs.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (lina::detail::may_share_memory(outs[i], outs[j]))
        throw alias_error("the views of " + names[j] + " and " + names[i] +
                          " may share memory; give each gradient memory of its own");
  return outs;
}

// A quadratic plan's backward in blocks of query rows, as its forward
// (row_blocks.hpp). The loss is a sum over the blocks, Σ_b dout_b · out_b, and
// block b's rows are its block plan's output, so the gradients are the sums
// of the block plans' gradients: ∂ of an input read as queries is written a
// block of rows at a time; those of inputs read as keys (∂K, ∂V: the keys up
// to the block's last row under a mask) or whole (a map's W) add up over the
// blocks. A slice's blocks run in order (the last first) on one thread, so
// every sum is made in one order (the same bits from run to run), and slices
// run in parallel.
// The scores of a block are R x N, as the forward's, where the whole backward
// makes N x N matrices. False where the plan runs whole: as the forward's
// (the simple path, one block, an output that reaches an element twice),
// and a gradient in memory an input may share.
template <class T, class BP, class P, class Bound, std::size_t G>
bool run_gradient_blocks(P const& fwd, Bound const& in, std::array<tensor_view<T>, G> const& outs) {
  using Nd = typename P::shape::rows;
  auto const bundle = as_bundle(backward_of(row_blocks::block_plan(fwd)));
  using BBP = std::remove_cvref_t<decltype(backward_of(row_blocks::block_plan(fwd)))>;
  using bundle_t = std::remove_cvref_t<decltype(bundle)>;
  using block_bound = bound_inputs<inputs_of<bundle_t>, dims_of<bundle_t>, typename Bound::view_type>;
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    return gradient_count<BBP> == G &&
           ((entry_of<BBP, I>::input::name.view() == entry_of<BP, I>::input::name.view()) && ...);
  }(std::make_index_sequence<G>{}), "lina::cpu: a block plan's gradients in another order than its plan's");
  std::size_t const n = in.table.template get<Nd>(), r = row_blocks::rows_per_block(n);
  if (current_path() == path::simple || n <= r) return false;
  for (auto const& o : outs) {
    if (lina::detail::overlaps_itself(o)) return false;
    for (auto const& v : in.views)
      if (lina::detail::may_share_memory(o, v)) return false;
  }
  check_head_decays(fwd, in.heads);  // (before the threads: it throws)
  constexpr bool cut_keys = row_blocks::verdict_of<P>().masks;
  constexpr std::array<bool, G> by_rows = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<bool, G>{std::is_same_v<typename entry_of<BBP, I>::input::rows, row_blocks::query_rows<Nd>>...};
  }(std::make_index_sequence<G>{});
  cached_workspace<T> per_call;
  workspace<T>& ws = per_call.per_thread();
  [[maybe_unused]] bool const threads = outside_parallel();  // (read by the pragma alone)
  long const slices = static_cast<long>(in.batch * in.heads);
#pragma omp parallel for schedule(dynamic, 1) if (threads)
  for (long bh = 0; bh < slices; ++bh) {
    std::size_t const b = static_cast<std::size_t>(bh) / in.heads, h = static_cast<std::size_t>(bh) % in.heads;
    // The sums: a block's share of each in a buffer of its own (counted, as
    // every temporary), added to the gradient's slice, zeroed first.
    std::array<buffer<T>, G> share;
    for (std::size_t k = 0; k < G; ++k)
      if (!by_rows[k]) {
        auto const s = outs[k].shape();
        share[k] = buffer<T>(s[2] * s[3]);
        for_each_index(shape4{1, 1, s[2], s[3]}, [&](std::size_t, std::size_t, std::size_t i, std::size_t j) {
          outs[k](b, h, i, j) = T(0);
        });
      }
    // (the last rows first: with a mask they read the most keys, so what the
    // first block takes from the thread's arena fits every later one)
    for (std::size_t x = (n + r - 1) / r; x-- > 0;) {
      std::size_t const r0 = x * r, rows = std::min(r, n - r0);
      auto const bound = block_bindings<block_bound, Nd>(in, r0, rows, cut_keys ? r0 + rows : n);
      std::array<tensor_view<T>, G> block_outs;
      std::array<std::size_t, G> extent{};  // the rows of each share
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        auto one = [&]<std::size_t K>() {
          if (by_rows[K]) {
            block_outs[K] = outs[K].rows(r0, rows);
          } else {
            auto const& v = bound.views[block_bound::template input_index<typename entry_of<BBP, K>::input>()];
            extent[K] = v.shape()[2];
            auto const cols = static_cast<std::ptrdiff_t>(v.shape()[3]);
            // (every slice at the same place: one slice of it is written per run)
            block_outs[K] = tensor_view<T>(share[K].get(), {in.batch, in.heads, extent[K], v.shape()[3]}, {0, 0, cols, 1});
          }
        };
        (one.template operator()<I>(), ...);
      }(std::make_index_sequence<G>{});
      program<T, bundle_t, block_bound, G> prog(bundle, bound, block_outs, nullptr, ws, true);
      prog.run(b, h);
      for (std::size_t k = 0; k < G; ++k)
        if (!by_rows[k]) {
          std::size_t const cols = outs[k].shape()[3];
          for (std::size_t i = 0; i < extent[k]; ++i)
            for (std::size_t j = 0; j < cols; ++j) outs[k](b, h, i, j) += share[k].get()[i * cols + j];
        }
    }
  }
  return true;
}

// Run backward plan bp's bundle into the gradient views: in blocks of query
// rows where its forward qualifies (above) and is softmax-like (has an exp),
// else whole. A quadratic order of linear attention runs whole: its linear
// order needs O(N) memory, and an automatic plan takes the quadratic branch
// only below the crossover (tens of rows), where a block is the whole plan;
// its blocked backward would be code compiled for nothing (a CI build took
// 250 CPU-seconds longer with it).
template <class T, class BP, class Bound, std::size_t G>
void run_backward(BP const& bp, Bound const& in, std::array<tensor_view<T>, G> const& outs) {
  bool done = false;
  with_resolved_plan(bp.forward, in.table, [&](auto const& fwd) {
    using F = std::remove_cvref_t<decltype(fwd)>;
    if constexpr (contains_op<F, op::exp>() && row_blocks::eligible<F>()) done = run_gradient_blocks<T, BP>(fwd, in, outs);
  });
  if (!done) with_resolved_plan(as_bundle(bp), in.table, [&](auto const& p) { run_slices<T>(p, in, outs); });
}
}  // namespace detail

// gradient(plan or backward_plan, dout, bindings...) -> gradients: g[Q], g[K], ...
template <class P, class D, class... B>
  requires(is_binding<B> && ...)
auto gradient(P const& plan, D const& dout, B const&... bindings) {
  auto const bp = backward_of(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  auto in = detail::bind_backward(bp, dout, bindings...);
  using T = typename decltype(in)::value_type;
  std::array<tensor_view<T>, detail::gradient_count<BP>> outs;
  auto g = detail::new_gradients<T, BP>(in, outs);
  detail::run_backward<T>(bp, in, outs);
  return g;
}

// Gradients written into caller memory, for loops that reuse their buffers
// (each fresh gradient tensor is first-touched memory: at B·H = 8, N = 16384,
// D = 64, three of them are 96 MB a call). `into[Q]` is a view shaped like Q,
// in any layout: auto into = cpu::gradient_views<float>(plan); into[Q] = dq.view();
// ...; cpu::gradient_into(plan, into, dout, Q = q, K = k, V = v). A view of
// the wrong shape (or one not set) is a lina::shape_error before anything runs.
template <class T, class P>
auto gradient_views(P const& plan) {
  return gradients_of<tensor_view<T>, std::remove_cvref_t<decltype(backward_of(plan))>>{};
}
template <class P, class T, class... In, class D, class... B>
  requires(is_binding<B> && ...)
void gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, B const&... bindings) {
  auto const bp = backward_of(plan);
  using BP = std::remove_cvref_t<decltype(bp)>;
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_of<tensor_view<T>, BP>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  static_assert(std::is_same_v<std::remove_const_t<typename decltype(view_of(dout))::element_type_>, T>,
                "lina::cpu::gradient_into: the gradient views and dout must have one element type");
  auto in = detail::bind_backward(bp, dout, bindings...);
  auto outs = detail::checked_gradient_views<BP>(in, into);
  detail::run_backward<T>(bp, in, outs);
}

// ---- chained blocks ----
// gradient(plan, dout, initial, d_final, Q = q, …) -> {gradients, ∂initial}:
// the backward of one block of a sequence evaluated through a state
// (evaluate(plan, st, …)). `initial` holds the running sums the block started
// from (copy the state before evaluating the block; unsized: zeros, the first
// block), `d_final` the gradient of the sums it left (the next block's
// ∂initial; unsized: zeros, the last block). Blocks are differentiated last
// first, each handing its ∂initial to the one before; joined, their gradients
// are the one-pass gradients. Nothing new runs: the derived backward's prefix
// scans (the recomputed forward, ∂Q's) start from `initial`, its suffix scans
// (∂K's, ∂V's) from `d_final`, and what a suffix scan ends with is ∂initial.
// A stack carries one state per layer: each scan of the backward belongs to
// the layer whose forward scan it sums (its operands say which), starts from
// that layer's initial or d_final sums and hands back that layer's ∂initial.
namespace detail {
// contract(A, prefix|suffix(B⊗C)): its operands' types.
template <class N>
struct scan_operands;
template <class A, class Op, class B, class C>
struct scan_operands<node<op::contract_rows, A, node<Op, node<op::outer_rows, B, C>>>> {
  using a = A;
  using b = B;
  using c = C;
};
// The forward plan L as a backward reads it: as it is, or, as a tape's saved
// backward reads it (cpu/tape.hpp), with its kept values (Kept, lina/saved.hpp)
// read as inputs saved1, saved2, …: there layer 2's scan reads φ(rowdiv(saved1)),
// not layer 1's scan.
template <class L, class Kept>
struct reading_saved {};
template <class L>
struct plan_of {
  using type = L;
};
template <class L, class Kept>
struct plan_of<reading_saved<L, Kept>> {
  using type = L;
};
template <class R, class X>
struct as_read {
  using type = X;
};
template <class L, class Kept, class X>
struct as_read<reading_saved<L, Kept>, X> {
  using type = std::remove_cvref_t<decltype(lina::detail::read_saved<L, Kept>(std::declval<X const&>()))>;
};
// The forward's K-th scan, contract(A, prefix(B⊗C)): its state is B's columns
// x C's. (R: the forward plan, or reading_saved<plan, Kept>.)
template <class R, std::size_t K>
struct forward_scan {
  using S = schedule_of<typename plan_of<R>::type>;
  static constexpr std::size_t step = [] {
    std::size_t j = 0, seen = 0;
    for (;; ++j)
      if (S::scan_index[j] != sched::none && seen++ == K) return j;
  }();
  using scan = scan_operands<typename S::template node_type<step>>;
  struct parts {
    using a = typename as_read<R, typename scan::a>::type;
    using b = typename as_read<R, typename scan::b>::type;
    using c = typename as_read<R, typename scan::c>::type;
  };
};
// Does scan step J of the backward's schedule SB sum forward scan K's state (a
// prefix scan: its B⊗C or C⊗B) or that state's gradient (a suffix scan: A⊗G
// or G⊗A)? And are its sums laid out as that state's transpose?
template <class L, class SB, std::size_t J, std::size_t K>
struct scan_match {
  using F = typename forward_scan<L, K>::parts;
  using P = scan_operands<typename SB::template node_type<J>>;
  static constexpr bool prefix = SB::template is_prefix_scan<J>;
  static constexpr bool same = prefix ? std::is_same_v<typename P::b, typename F::b> && std::is_same_v<typename P::c, typename F::c>
                                      : std::is_same_v<typename P::b, typename F::a>;
  static constexpr bool swapped = prefix ? std::is_same_v<typename P::b, typename F::c> && std::is_same_v<typename P::c, typename F::b>
                                         : std::is_same_v<typename P::c, typename F::a>;
  static constexpr bool found = same || swapped;
};
// The forward scan (layer) whose state backward scan J sums, and whether its
// sums are that state's transpose.
template <class L, class SB, std::size_t J>
struct layer_of_scan {
  static constexpr std::size_t layers = state_scans<typename plan_of<L>::type>::size;
  static constexpr std::size_t matches = [] {
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return (std::size_t{scan_match<L, SB, J, K>::found} + ... + 0);
    }(std::make_index_sequence<layers>{});
  }();
  static_assert(matches == 1, "lina::cpu::gradient (chained): a scan of the backward that sums no one layer's state");
  static constexpr std::size_t layer = [] {
    std::size_t k = 0;
    [&]<std::size_t... K>(std::index_sequence<K...>) { ((scan_match<L, SB, J, K>::found ? (k = K, 0) : 0), ...); }(
        std::make_index_sequence<layers>{});
    return k;
  }();
  static constexpr bool transposed = !scan_match<L, SB, J, layer>::same;
  // A suffix scan's adjoint rows G (its operand beside the layer's A; void
  // for a prefix scan). Scans of one layer with the same G sum one gradient of
  // its state (∂K's and ∂V's, transposes of each other); a layer whose output
  // is read twice gets one G per read, each a part of that gradient.
  using parts = scan_operands<typename SB::template node_type<J>>;
  using adjoint = std::conditional_t<SB::template is_prefix_scan<J>, void,
                                     std::conditional_t<transposed, typename parts::b, typename parts::c>>;
};
// Does scan step I of SB sum the same part of the same layer's ∂state as suffix scan J?
template <class L, class SB, std::size_t I, std::size_t J>
constexpr bool same_part() {
  if constexpr (SB::template is_scan<I> && !SB::template is_prefix_scan<I>)
    return layer_of_scan<L, SB, I>::layer == layer_of_scan<L, SB, J>::layer &&
           std::is_same_v<typename layer_of_scan<L, SB, I>::adjoint, typename layer_of_scan<L, SB, J>::adjoint>;
  else
    return false;
}
// The first suffix scan of SB that sums suffix scan J's part (J itself if none before).
template <class L, class SB, std::size_t J>
constexpr std::size_t part_of_scan() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    std::size_t r = J;
    ((r == J && same_part<L, SB, I, J>() ? void(r = I) : void()), ...);
    return r;
  }(std::make_index_sequence<J>{});
}
// f(J, its layer, prefix?, transposed?, its part: part_of_scan, J for a
// prefix scan) for each scan step J of SB, in order.
template <class L, class SB, class F>
void for_each_backward_scan(F&& f) {
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    auto one = [&]<std::size_t K>(std::integral_constant<std::size_t, K>) {
      if constexpr (SB::template is_prefix_scan<K>)
        f(K, layer_of_scan<L, SB, K>::layer, true, layer_of_scan<L, SB, K>::transposed, K);
      else if constexpr (SB::template is_scan<K>)
        f(K, layer_of_scan<L, SB, K>::layer, false, layer_of_scan<L, SB, K>::transposed, part_of_scan<L, SB, K>());
    };
    (one(std::integral_constant<std::size_t, J>{}), ...);
  }(std::make_index_sequence<SB::size>{});
}
// Copy (or add) one (batch, head)'s running sums, rows x cols, or their transpose.
template <class T>
void copy_sums(T const* from, T* to, std::size_t rows, std::size_t cols, bool transpose, bool add = false) {
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) {
      T& x = transpose ? to[j * rows + i] : to[i * cols + j];
      x = add ? x + from[i * cols + j] : from[i * cols + j];
    }
}
}  // namespace detail

namespace detail {
// The chained backward bp of the linear form `linear` into the views `outs`
// (checked), its bundle bound in `in` and the forward's inputs in `fwd`: the
// derived backward (R = L), or a tape's saved form of it (cpu/tape.hpp; R =
// reading_saved<L, its kept values>), whose scans are the same but for the
// forward's that it reads as saved values.
template <class T, class R, class L, class BP, class Bound, class FwdBound, std::size_t G>
state<T> chained_backward(L const& linear, BP const& bp, Bound const& in, FwdBound const& fwd,
                          std::array<tensor_view<T>, G> const& outs, state<T> const& initial, state<T> const& d_final) {
  static_assert(std::is_same_v<typename Bound::value_type, T>,
                "lina::cpu::gradient (chained): the states and the inputs must have one element type");
  // The states checked against this block (plan, batch, heads, extents), unsized ones as zeros.
  state<T> s0 = initial, ds1 = d_final, ds0(linear, fwd.batch, fwd.heads);
  s0.prepare(linear, fwd);
  ds1.prepare(linear, fwd);
  ds0.prepare(linear, fwd);
  auto const bundle = as_bundle(bp);
  using SB = schedule_of<std::remove_cvref_t<decltype(bundle)>>;
  state<T> sums(bundle, in.batch, in.heads);  // every scan of the backward, filled before it runs
  sums.prepare(bundle, in);
  // f(J, its layer, prefix?, transposed?, its part) for each scan J of the
  // backward; its sums are its layer's state's size, C x W, or that laid out
  // transposed.
  auto each_scan = [&](auto const& f) {
    for_each_backward_scan<R, SB>([&](std::size_t j, std::size_t layer, bool prefix, bool transposed, std::size_t part) {
      auto const& have = sums.scan(SB::scan_index[j]);
      if (have.a * have.b != s0.scan(layer).a * s0.scan(layer).b)
        throw std::logic_error("lina::cpu::gradient (chained): a backward scan's sums are not its layer's state's size");
      f(j, layer, prefix, transposed, part);
    });
  };
  // Prefix scans start from their layer's sums; the suffix scans of a layer's
  // first part from d_final, of its other parts (a layer read twice) from
  // zeros: d_final enters the layer's ∂state once.
  std::vector<std::size_t> first_part(state_scans<L>::size, SB::size);
  each_scan([&](std::size_t j, std::size_t layer, bool prefix, bool transposed, std::size_t part) {
    std::size_t const c = s0.scan(layer).a, w = s0.scan(layer).b;
    if (!prefix && first_part[layer] == SB::size) first_part[layer] = part;
    for (std::size_t b = 0; b < in.batch; ++b) {
      for (std::size_t h = 0; h < in.heads; ++h)
        if (prefix || part == first_part[layer])
          copy_sums(prefix ? s0.at(layer, b, h) : ds1.at(layer, b, h), sums.at(SB::scan_index[j], b, h), c, w,
                    transposed);
        else
          std::fill_n(sums.at(SB::scan_index[j], b, h), c * w, T(0));
      // (the rows before the block, or after it: where one pass would have summed them)
      sums.set_rows(SB::scan_index[j], b, prefix ? s0.rows(layer, b) : ds1.rows(layer, b));
    }
  });
  run_slices<T>(bundle, in, outs, &sums);
  // Each layer's ∂initial: the sum of its parts, each what the first of its
  // suffix scans that ran ends with (a paired one runs in its dual's pass).
  std::vector<bool> added(SB::size);
  each_scan([&](std::size_t j, std::size_t layer, bool prefix, bool transposed, std::size_t part) {
    if (prefix || added[part] || SB::runs_in[j] != j) return;
    added[part] = true;
    std::size_t const c = s0.scan(layer).a, w = s0.scan(layer).b, rows = transposed ? w : c;
    for (std::size_t b = 0; b < in.batch; ++b) {
      for (std::size_t h = 0; h < in.heads; ++h)
        copy_sums(sums.at(SB::scan_index[j], b, h), ds0.at(layer, b, h), rows, c * w / rows, transposed, true);
      ds0.set_rows(layer, b, sums.rows(SB::scan_index[j], b));
    }
  });
  return ds0;
}
}  // namespace detail

// gradient_into(plan, into, dout, initial, d_final, Q = q, …) -> ∂initial: the
// same into the caller's views (checked first, as gradient_into's).
template <class P, class T, class... In, class D, class... B>
  requires(is_binding<B> && ...)
state<T> gradient_into(P const& plan, gradients<tensor_view<T>, In...>& into, D const& dout, state<T> const& initial,
                       state<T> const& d_final, B const&... bindings) {
  auto const linear = longest_branch(plan);
  using L = std::remove_cvref_t<decltype(linear)>;
  static_assert(check_stateful<L>());
  auto const bp = backward_of(linear);
  using BP = std::remove_cvref_t<decltype(bp)>;
  static_assert(std::is_same_v<gradients<tensor_view<T>, In...>, gradients_of<tensor_view<T>, BP>>,
                "lina::cpu::gradient_into: `into` must be cpu::gradient_views<T>(plan) of this plan");
  auto in = detail::bind_backward(bp, dout, bindings...);
  auto outs = detail::checked_gradient_views<BP>(in, into);
  return detail::chained_backward<T, L>(linear, bp, in, bind<L>(bindings...), outs, initial, d_final);
}
template <class P, class D, class T, class... B>
  requires(is_binding<B> && ...)
auto gradient(P const& plan, D const& dout, state<T> const& initial, state<T> const& d_final, B const&... bindings) {
  auto [g, into] = detail::new_gradients_into(longest_branch(plan), dout, bindings...);
  state<T> d_initial = gradient_into(plan, into, dout, initial, d_final, bindings...);
  return std::pair{std::move(g), std::move(d_initial)};
}

}  // namespace lina::cpu
