// Checking the math of an attention variant, on the CPU in double:
//
//   auto g = lina::check::gradients(my_attention);  // derived gradients = central differences?
//   auto o = lina::check::orderings(my_attention);  // every evaluation order = the expression as written?
//   auto s = lina::check::recurrent(my_attention);  // steps and chained blocks = the expression as written?
//   CHECK_MESSAGE(g.ok(), g);                       // (doctest) the report says where, and by how much
//
// For whoever writes a feature map or a variant: a map's derivative or vjp is
// written by hand, and a wrong one gives wrong gradients without any error.
// Each trial draws the batch, the heads (unless the expression's decays per
// head say how many) and every dynamic dimension (1 to
// max_extent, distinct where the range allows, so that a transposed index
// cannot pass), signed inputs and dout uniform in [low, high), and compares
//  - gradients: ∂L/∂X for every input X, L = Σ dout ⊙ out, from cpu::gradient
//    of the expression as written and of each compiled order (automatic,
//    quadratic, linear where one exists), against central differences of L
//    evaluated as written;
//  - orderings: the output of each compiled order against the expression as
//    written;
//  - recurrent (causal variants): the output of recurrent steps and of two
//    chained blocks, and the two blocks' gradients joined, against the
//    expression as written.
// An element's error is |got − want| / (1 + |want|); the report keeps the
// worst per (order, quantity) over the trials, with the element and extents.
// A NaN anywhere is an error that fails.
//
// An expression whose sequence dimension compile() cannot tell takes it as
// the second argument, as compile does: check::gradients(e, N).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lina/bind.hpp"
#include "lina/compile.hpp"
#include "lina/cpu.hpp"
#include "lina/dims.hpp"
#include "lina/node.hpp"
#include "lina/tensor.hpp"

namespace lina::check {

// Each check throws std::invalid_argument, naming the option, for a trials or an
// extent bound below 1, low >= high, a step <= 0, a negative tolerance, or a NaN.
struct options {
  int trials = 3;
  std::size_t max_extent = 6;  // dynamic dimensions: 1 .. max_extent
  std::size_t max_batch = 2, max_heads = 2;
  double low = -1, high = 1;  // inputs and dout: uniform in [low, high)
  double step = 1e-6;         // central differences: (L(x + step) − L(x − step)) / (2 step)
  // Far above a central difference's error in double (step² |L'''| / 6 plus
  // the rounding of L over 2 step, ~1e-9 at unit scale) and far below any wrong term.
  double tolerance = 1e-6;
  std::uint64_t seed = 1;
};

// The worst element of one quantity of one order over the trials.
struct finding {
  std::string quantity;  // "∂Q", "out", "out (steps)", "out (two blocks)", "∂Q (two blocks)"
  std::string order;     // "as written", "order::automatic", "order::quadratic", "order::linear"
  double error = 0;      // |got − want| / (1 + |want|); NaN if an element was NaN
  double got = 0, want = 0;
  shape4 at{};          // [batch, head, row, col] of that element
  std::string extents;  // of its trial: "B=1 H=2 N=5 D=3 M=4"
};

struct report {
  std::string check;  // "gradients", "orderings" or "recurrent"
  double tolerance = 0;
  int trials = 0;
  std::vector<finding> findings;

  bool passes(finding const& f) const { return f.error <= tolerance; }  // NaN fails
  // Every finding passes (and there is one: a report that checked nothing fails).
  bool ok() const {
    return !findings.empty() && std::all_of(findings.begin(), findings.end(), [&](finding const& f) { return passes(f); });
  }
  // A NaN first, else the largest error.
  finding const& worst() const {
    if (findings.empty()) throw std::logic_error("lina::check: the report has no findings");
    return *std::max_element(findings.begin(), findings.end(), [](finding const& a, finding const& b) {
      return !std::isnan(a.error) && (std::isnan(b.error) || a.error < b.error);
    });
  }
  std::string str() const {
    std::string s = fmt::format("lina::check::{}: {} (tolerance {:g}, {} trials; error = |got - want| / (1 + |want|))\n",
                                check, ok() ? "ok" : "FAILED", tolerance, trials);
    auto width = [](std::string const& t) {  // in characters (UTF-8: ∂)
      return static_cast<std::size_t>(std::count_if(t.begin(), t.end(), [](char c) { return (c & 0xC0) != 0x80; }));
    };
    std::size_t wq = 0, wo = 0;
    for (finding const& f : findings) wq = std::max(wq, width(f.quantity)), wo = std::max(wo, width(f.order));
    for (finding const& f : findings)
      s += fmt::format("  {} {}{:{}} {}{:{}} {:<9.3g} at [{},{},{},{}]: got {:.9g}, want {:.9g} ({})\n",
                       passes(f) ? " " : "x", f.quantity, "", wq - width(f.quantity), f.order, "",
                       wo - width(f.order), f.error, f.at[0], f.at[1], f.at[2], f.at[3], f.got, f.want, f.extents);
    return s;
  }
  friend std::ostream& operator<<(std::ostream& os, report const& r) { return os << r.str(); }
};

namespace detail {

// Options that would check nothing, or not what they say, are an error
// before any trial: a check with zero trials must not pass.
inline void validate(options const& o) {
  auto fail = [](char const* what, auto value) {
    throw std::invalid_argument(fmt::format("lina::check: options.{} = {}; {}", what, value,
                                            "trials, max_extent, max_batch and max_heads must be at least 1, "
                                            "low < high finite, step > 0 finite, tolerance >= 0"));
  };
  if (o.trials < 1) fail("trials", o.trials);
  if (o.max_extent < 1) fail("max_extent", o.max_extent);
  if (o.max_batch < 1) fail("max_batch", o.max_batch);
  if (o.max_heads < 1) fail("max_heads", o.max_heads);
  if (!std::isfinite(o.low)) fail("low", o.low);
  if (!std::isfinite(o.high) || !(o.low < o.high)) fail("high", o.high);
  if (!std::isfinite(o.step) || !(o.step > 0)) fail("step", o.step);
  if (!(o.tolerance >= 0)) fail("tolerance", o.tolerance);
}

struct rng {  // splitmix64, as lina::tensor::random
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53; }
  std::size_t in(std::size_t lo, std::size_t hi) { return lo + next() % (hi - lo + 1); }  // [lo, hi]
};

// One trial's extents, inputs (in the order of inputs_of<E>) and dout.
template <class E>
struct trial {
  using inputs = inputs_of<E>;
  extent_table<dims_of<E>> table;
  std::size_t batch = 1, heads = 1;
  std::array<tensor<double>, inputs::size> x;
  tensor<double> dout;
  std::string extents;

  // heads_fixed: the expression's decays per head say how many (0: drawn)
  trial(options const& o, rng& r, std::size_t heads_fixed = 0) {
    batch = r.in(1, o.max_batch);
    heads = heads_fixed ? heads_fixed : r.in(1, o.max_heads);
    extents = fmt::format("B={} H={}", batch, heads);
    // Dynamic extents from a shuffled 1..max_extent: distinct while it lasts.
    std::vector<std::size_t> pool(o.max_extent);
    std::iota(pool.begin(), pool.end(), std::size_t{1});
    for (std::size_t i = pool.size(); i > 1; --i) std::swap(pool[i - 1], pool[r.next() % i]);
    std::size_t next = 0;
    [&]<class... Dim>(lina::detail::type_list<Dim...>) {
      auto one = [&]<class X>() {
        std::size_t& e = table.value[table.template index_of<X>()];
        e = X::is_static ? X::static_extent : next < pool.size() ? pool[next++] : r.in(1, pool.size());
        extents += fmt::format(" {}={}", X::label(), e);
      };
      (one.template operator()<Dim>(), ...);
    }(dims_of<E>{});
    auto fill = [&](shape4 s) {
      tensor<double> t(s);
      for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = r.uniform(o.low, o.high);
      return t;
    };
    std::size_t k = 0;
    [&]<class... I>(lina::detail::type_list<I...>) {
      ((x[k++] = fill({batch, heads, static_cast<std::size_t>(I::rows::extent(table)),
                       static_cast<std::size_t>(I::cols::extent(table))})),
       ...);
    }(inputs{});
    using S = typename E::shape;
    dout = fill({batch, heads, static_cast<std::size_t>(S::rows::extent(table)),
                 static_cast<std::size_t>(S::cols::extent(table))});
  }

  // f(Q = x[0], K = x[1], ...): the inputs bound by name.
  template <class F>
  decltype(auto) bound(F&& f) const {
    return [&]<class... I>(lina::detail::type_list<I...>) -> decltype(auto) {
      return f(make_binding<I::name>(x[lina::detail::index_of_v<I, inputs>])...);
    }(inputs{});
  }
  // The same with the inputs whose rows are Seq cut to rows [first, first + n)
  // (views; an input of other rows, as W, whole).
  template <class Seq, class F>
  decltype(auto) bound_rows(std::size_t first, std::size_t n, F&& f) const {
    return [&]<class... I>(lina::detail::type_list<I...>) -> decltype(auto) {
      auto rows = [&]<class In>() {
        tensor_view<double const> v = x[lina::detail::index_of_v<In, inputs>].view();
        if constexpr (!std::is_same_v<typename In::rows, Seq>)
          return v;
        else
          return v.rows(first, n);
      };
      return f(make_binding<I::name>(rows.template operator()<I>())...);
    }(inputs{});
  }
};

inline finding named(std::string quantity, std::string order) {
  finding f;
  f.quantity = std::move(quantity);
  f.order = std::move(order);
  return f;
}

// Keep the worse of f's element and (got, want) at `at`.
inline void compare(finding& f, double got, double want, shape4 at, std::string const& extents) {
  double const e = std::abs(got - want) / (1 + std::abs(want));
  bool const worse = std::isnan(e) ? !std::isnan(f.error) : !std::isnan(f.error) && e > f.error;
  if (worse || f.extents.empty()) f = {f.quantity, f.order, e, got, want, at, extents};
}
inline void compare(finding& f, tensor<double> const& got, tensor<double> const& want, std::string const& extents) {
  if (got.shape() != want.shape())
    throw std::logic_error("lina::check: " + f.quantity + " has another shape than its reference");
  for_each_index(want.shape(), [&](std::size_t b, std::size_t h, std::size_t n, std::size_t d) {
    compare(f, got.view()(b, h, n, d), want.view()(b, h, n, d), {b, h, n, d}, extents);
  });
}

// f(name, plan) for each compiled order of e (its sequence dimension Key).
template <class E, class Key, class F>
void for_each_order(E const& e, Key key, F&& f) {
  f("order::automatic", compile<order::automatic>(e, key));
  f("order::quadratic", compile<order::quadratic>(e, key));
  if constexpr (has_linear_order<E, Key>) f("order::linear", compile<order::linear>(e, key));
}

template <class E>
double loss(E const& e, trial<E> const& t) {
  auto out = t.bound([&](auto const&... b) { return cpu::evaluate(e, b...); });
  double s = 0;
  for_each_index(out.shape(), [&](auto... i) { s += out.view()(i...) * t.dout.view()(i...); });
  return s;
}

}  // namespace detail

namespace diagnose {
template <bool Known>
struct check_sequence_dimension {
  static_assert(Known,
                "lina::check: the sequence dimension cannot be told from the expression's structure; name it as "
                "compile(e, N) takes it: check::gradients(e, N), check::orderings(e, N), check::recurrent(e, N)");
  static constexpr bool ok = Known;
};
}  // namespace diagnose

// Derived gradients against central differences (see the top of this file).
template <class E, class Key>
  requires(is_node<E> && concepts::base_dimension<Key>)
report gradients(E const& e, Key key, options const& o = {}) {
  using inputs = inputs_of<E>;
  detail::validate(o);
  report r{"gradients", o.tolerance, o.trials, {}};
  detail::rng g{o.seed};
  auto slot = [&](std::string quantity, std::string order) -> finding& {
    for (finding& f : r.findings)
      if (f.quantity == quantity && f.order == order) return f;
    return r.findings.emplace_back(detail::named(std::move(quantity), std::move(order)));
  };
  for (int trial = 0; trial < o.trials; ++trial) {
    detail::trial<E> t(o, g, heads_of_decays(e));
    // Central differences of L, evaluated as written, for every element of every input.
    std::array<tensor<double>, inputs::size> fd;
    for (std::size_t k = 0; k < inputs::size; ++k) {
      fd[k] = tensor<double>(t.x[k].shape());
      for_each_index(t.x[k].shape(), [&](auto... i) {
        double& x = t.x[k].view()(i...);
        double const keep = x;
        x = keep + o.step;
        double const up = detail::loss(e, t);
        x = keep - o.step;
        double const down = detail::loss(e, t);
        x = keep;
        fd[k].view()(i...) = (up - down) / (2 * o.step);
      });
    }
    auto one = [&](std::string const& order, auto const& plan) {
      auto gr = t.bound([&](auto const&... b) { return cpu::gradient(plan, t.dout, b...); });
      std::size_t k = 0;
      [&]<class... I>(lina::detail::type_list<I...>) {
        ((detail::compare(slot("∂" + std::string(I::name.view()), order), gr[node<I>{}], fd[k], t.extents), ++k), ...);
      }(inputs{});
    };
    one("as written", e);
    detail::for_each_order(e, key, one);
  }
  return r;
}

// Each compiled order's output against the expression evaluated as written.
template <class E, class Key>
  requires(is_node<E> && concepts::base_dimension<Key>)
report orderings(E const& e, Key key, options const& o = {}) {
  detail::validate(o);
  report r{"orderings", o.tolerance, o.trials, {}};
  detail::rng g{o.seed};
  for (int trial = 0; trial < o.trials; ++trial) {
    detail::trial<E> t(o, g, heads_of_decays(e));
    auto want = t.bound([&](auto const&... b) { return cpu::evaluate(e, b...); });
    std::size_t k = 0;
    detail::for_each_order(e, key, [&](std::string const& order, auto const& plan) {
      if (trial == 0) r.findings.push_back(detail::named("out", order));
      detail::compare(r.findings[k++], t.bound([&](auto const&... b) { return cpu::evaluate(plan, b...); }), want,
                      t.extents);
    });
  }
  return r;
}

// A causal variant's recurrent mode against the expression as written: the
// output of cpu::recurrent's steps, token by token, and of two blocks chained
// through a cpu::state (cut at a random row, 0 and N included), each against
// the whole sequence evaluated as written ("out (steps)", "out (two blocks)");
// and the two blocks' gradients, the second differentiated first and handing
// back ∂ of the state between them, joined, against cpu::gradient of the whole
// expression as written ("∂Q (two blocks)", …; an input whose rows are not the
// sequence's, as W, sums the blocks' gradients). The chained backward uses the
// map's derivative as the one-pass backward does: check::gradients checks that.
// A plan without a running state (no causal mask, softmax) is a compile error,
// as for cpu::recurrent.
template <class E, class Key>
  requires(is_node<E> && concepts::base_dimension<Key>)
report recurrent(E const& e, Key key, options const& o = {}) {
  detail::validate(o);
  using inputs = inputs_of<E>;
  report r{"recurrent", o.tolerance, o.trials, {detail::named("out (steps)", "order::automatic"),
                                                detail::named("out (two blocks)", "order::automatic")}};
  [&]<class... I>(lina::detail::type_list<I...>) {
    (r.findings.push_back(detail::named("∂" + std::string(I::name.view()) + " (two blocks)", "order::automatic")), ...);
  }(inputs{});
  auto const plan = compile(e, key);
  detail::rng g{o.seed};
  for (int trial = 0; trial < o.trials; ++trial) {
    detail::trial<E> t(o, g, heads_of_decays(e));
    auto const want = t.bound([&](auto const&... b) { return cpu::evaluate(e, b...); });
    std::size_t const n = want.shape()[2];
    tensor<double> steps(want.shape()), blocks(want.shape());
    auto rnn = cpu::recurrent<double>(plan, t.batch, t.heads);
    for (std::size_t i = 0; i < n; ++i)
      t.template bound_rows<Key>(i, 1, [&](auto const&... b) {
        rnn.step_into(steps.rows(i, 1), b...);
      });
    cpu::state<double> st, between;
    std::size_t const cut = g.in(0, n);
    for (int block = 0; block < 2; ++block) {
      std::size_t const first = block == 0 ? 0 : cut, count = block == 0 ? cut : n - cut;
      t.template bound_rows<Key>(first, count, [&](auto const&... b) {
        cpu::evaluate_into(plan, blocks.rows(first, count), st, b...);
      });
      if (block == 0) between = st;
    }
    std::string const extents = t.extents + fmt::format(", cut at {}", cut);
    detail::compare(r.findings[0], steps, want, t.extents);
    detail::compare(r.findings[1], blocks, want, extents);

    // Backward through the two blocks: the second from the state the first
    // left, handing back ∂ of it; the first from a zero state, given that ∂.
    cpu::state<double> const none;
    auto const whole = t.bound([&](auto const&... b) { return cpu::gradient(e, t.dout, b...); });
    auto const second = t.template bound_rows<Key>(cut, n - cut, [&](auto const&... b) {
      return cpu::gradient(plan, t.dout.rows(cut, n - cut), between, none, b...);
    });
    auto const first = t.template bound_rows<Key>(0, cut, [&](auto const&... b) {
      return cpu::gradient(plan, t.dout.rows(0, cut), none, second.second, b...);
    });
    std::size_t k = 2;
    [&]<class... I>(lina::detail::type_list<I...>) {
      auto one = [&]<class In>() {
        tensor<double> const& a = first.first[node<In>{}];
        tensor<double> const& b = second.first[node<In>{}];
        tensor<double> joined(whole[node<In>{}].shape());
        for_each_index(joined.shape(), [&](std::size_t b0, std::size_t h, std::size_t i, std::size_t j) {
          if constexpr (std::is_same_v<typename In::rows, Key>)
            joined.view()(b0, h, i, j) = i < cut ? a.view()(b0, h, i, j) : b.view()(b0, h, i - cut, j);
          else
            joined.view()(b0, h, i, j) = a.view()(b0, h, i, j) + b.view()(b0, h, i, j);
        });
        detail::compare(r.findings[k++], joined, whole[node<In>{}], extents);
      };
      (one.template operator()<I>(), ...);
    }(inputs{});
  }
  return r;
}

// The same, the sequence dimension told by the expression's structure.
namespace detail {
template <class E, class F>
report with_sequence_dim(F&& check) {
  using Key = sequence_dim<E>;
  if constexpr (diagnose::check_sequence_dimension<!std::is_void_v<Key>>::ok)
    return check(Key{});
  else
    return {};
}
}  // namespace detail
template <class E>
  requires is_node<E>
report gradients(E const& e, options const& o = {}) {
  return detail::with_sequence_dim<E>([&](auto key) { return gradients(e, key, o); });
}
template <class E>
  requires is_node<E>
report orderings(E const& e, options const& o = {}) {
  return detail::with_sequence_dim<E>([&](auto key) { return orderings(e, key, o); });
}
template <class E>
  requires is_node<E>
report recurrent(E const& e, options const& o = {}) {
  return detail::with_sequence_dim<E>([&](auto key) { return recurrent(e, key, o); });
}

}  // namespace lina::check
