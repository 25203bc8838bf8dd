// Softmax attention whose scores pass exp's range (88.7 in float, 709.8 in
// double): as written, exp overflows and the rows become inf/inf. The CPU
// backend keeps such rows with an exponent (lina/cpu/evaluate.hpp,
// "Exponents"), so the plans, the expression as written and the derived
// gradients give the values the expression denotes — checked here against
// the definition in long double, shifted by each row's largest score.
// (The CUDA kernels' running max: tests/test_cuda_forward.cpp, test_cuda_backward.cpp.)
// Then chains of row-wise ops on the scores in every order that changes what
// they mean (a mask before or after exp, before or after the normaliser, a
// scale between, a decay), against a dense interpreter of the ops in long
// double: the as-written evaluation shares the backend's row machinery (which
// exp rows are made only up to the diagonal, which products skip a masked
// triangle), so it cannot be the oracle for those.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_props.hpp"  // the symbols Q, K, V over dynamic N, D, M

using namespace lina;
using test::cpu_props::K;
using test::cpu_props::Q;
using test::cpu_props::V;

namespace {
enum class mask { none, after_exp, before_exp, after_normalize };

struct exact {  // the expression's outputs and gradients, [B, H, N, ·] in double
  tensor<double> out, dq, dk, dv;
};

// out_i = Σ_j e^(s_ij) v_j / (Σ_j e^(s_ij) + eps), s = scale·Q Kᵀ, the sums over the
// keys the mask keeps (the mask before exp makes a later key's score 0: it
// weighs e^0; a mask after the normaliser drops later keys' terms from
// out_i, not from the sum that normalises), in long double with each row shifted by m = max(0, its largest
// kept score): e^(s − m) / (Σ e^(s − m) + eps e^−m), the same value (a
// decayed mask after exp weighs key j by decay^(i−j) as well). The
// gradients from ∂out_i/∂s_ij = p_ij (v_j − out_i), p_ij = e^(s_ij) / (Σ + eps).
template <class T>
exact definition(tensor<T> const& q, tensor<T> const& k, tensor<T> const& v, tensor<T> const& g, mask mk,
                 double scale, double decay) {
  auto const& sh = q.shape();
  std::size_t const n = sh[2], d = sh[3], m = v.shape()[3];
  exact e{tensor<double>({sh[0], sh[1], n, m}), tensor<double>(sh), tensor<double>(sh), tensor<double>(v.shape())};
  using L = long double;
  for (std::size_t b = 0; b < sh[0]; ++b)
    for (std::size_t h = 0; h < sh[1]; ++h) {
      std::vector<L> dk(n * d, 0), dv(n * m, 0);
      for (std::size_t i = 0; i < n; ++i) {
        std::size_t const keys = mk == mask::after_exp ? i + 1 : n;
        std::vector<L> s(keys), p(keys), o(m, 0);
        L top = 0;
        for (std::size_t j = 0; j < keys; ++j) {
          L dot = 0;
          if (mk != mask::before_exp || j <= i)
            for (std::size_t c = 0; c < d; ++c) dot += L(q(b, h, i, c)) * L(k(b, h, j, c));
          s[j] = L(scale) * dot;
          top = std::max(top, s[j]);
        }
        L den = L(1e-6) * std::exp(-top);
        for (std::size_t j = 0; j < keys; ++j) den += p[j] = std::exp(s[j] - top) * std::pow(L(decay), L(i - j));
        auto const used = [&](std::size_t j) { return mk != mask::after_normalize || j <= i; };
        for (std::size_t j = 0; j < keys; ++j) {
          p[j] /= den;
          if (used(j))
            for (std::size_t x = 0; x < m; ++x) o[x] += p[j] * L(v(b, h, j, x));
        }
        L go = 0;
        for (std::size_t x = 0; x < m; ++x) {
          e.out(b, h, i, x) = double(o[x]);
          go += L(g(b, h, i, x)) * o[x];
        }
        for (std::size_t c = 0; c < d; ++c) e.dq(b, h, i, c) = 0;
        for (std::size_t j = 0; j < keys; ++j) {
          L gv = 0;
          for (std::size_t x = 0; used(j) && x < m; ++x) {
            gv += L(g(b, h, i, x)) * L(v(b, h, j, x));
            dv[j * m + x] += p[j] * L(g(b, h, i, x));
          }
          if (mk == mask::before_exp && j > i) continue;  // a constant score
          L ds = L(scale) * p[j] * (gv - go);
          for (std::size_t c = 0; c < d; ++c) {
            e.dq(b, h, i, c) += double(ds * L(k(b, h, j, c)));
            dk[j * d + c] += ds * L(q(b, h, i, c));
          }
        }
      }
      for (std::size_t j = 0; j < n; ++j) {
        for (std::size_t c = 0; c < d; ++c) e.dk(b, h, j, c) = double(dk[j * d + c]);
        for (std::size_t x = 0; x < m; ++x) e.dv(b, h, j, x) = double(dv[j * m + x]);
      }
    }
  return e;
}

// Largest |got − want| over |want|'s largest (1 at least), and whether every got is finite.
template <class T>
double relative_error(tensor<T> const& got, tensor<double> const& want) {
  double err = 0, scale = 1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(double(got.data()[i]))) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(double(got.data()[i]) - want.data()[i]));
    scale = std::max(scale, std::abs(want.data()[i]));
  }
  return err / scale;
}

template <class T, class Expr>
void check_past_exp_range(Expr const& expr, mask mk, std::uint64_t seed, double scale = 1, double decay = 1) {
  test::rng r{seed};
  double worst = 0;
  for (int trial = 0; trial < test::trials(6); ++trial) {
    std::size_t const b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 90), d = r.in(1, 12), m = r.in(1, 12);
    auto q = tensor<T>::random({b, h, n, d}, r.next()), k = tensor<T>::random({b, h, n, d}, r.next());
    auto v = tensor<T>::random({b, h, n, m}, r.next()), g = tensor<T>::random({b, h, n, m}, r.next());
    // Q scaled so that the largest score a row keeps is three times exp's limit in T.
    double top = 0;
    for (std::size_t x = 0; x < b * h; ++x)
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < (mk == mask::none || mk == mask::after_normalize ? n : i + 1); ++j) {
          double dot = 0;
          for (std::size_t c = 0; c < d; ++c)
            dot += double(q.data()[(x * n + i) * d + c]) * k.data()[(x * n + j) * d + c];
          top = std::max(top, dot);
        }
    if (top <= 0) continue;
    double const limit = std::log(double(std::numeric_limits<T>::max()));
    T const f = T(3 * limit / (scale * top));
    for (std::size_t x = 0; x < q.size(); ++x) q.data()[x] *= f;
    auto want = definition(q, k, v, g, mk, scale, decay);
    CONTEXT(b, h, n, d, m);
    // A score s carries a rounding error of about (√d + 2) ε |s| (its d
    // products summed, then exp and the division), |s| up to 3·limit, and an
    // output moves by p (v − out) per unit of score, |v − out| < 2.
    double const bound = 2 * (std::sqrt(double(d)) + 2) * 3 * limit * std::numeric_limits<T>::epsilon();
    auto plan = compile(expr);
    for (auto const& out : {cpu::evaluate(plan, Q = q, K = k, V = v), cpu::evaluate(expr, Q = q, K = k, V = v)}) {
      double e = relative_error(out, want.out);
      CHECK(e <= bound);
      worst = std::max(worst, e / bound);
    }
    // Through a tape too: softmax keeps nothing (lina/saved.hpp), the backward recomputes.
    static_assert(decltype(save_for_backward(plan))::size == 0);
    cpu::tape<T> tp;
    CHECK(relative_error(cpu::evaluate(plan, tp, Q = q, K = k, V = v), want.out) <= bound);
    // A gradient entry sums such weighted terms over the row's or column's keys.
    for (auto const& grads :
         {cpu::gradient(plan, g, Q = q, K = k, V = v), cpu::gradient(plan, tp, g, Q = q, K = k, V = v)})
      for (auto [got, w] :
           {std::pair{&grads[Q], &want.dq}, std::pair{&grads[K], &want.dk}, std::pair{&grads[V], &want.dv}}) {
        double e = relative_error(*got, *w);
        CHECK(e <= bound);
        worst = std::max(worst, e / bound);
      }
  }
  MESSAGE("largest error / bound: " << worst);
}
}  // namespace

TEST_CASE_TEMPLATE("softmax past exp's range: plans, as written and gradients = the definition", T, float, double) {
  check_past_exp_range<T>(normalize(exp(Q * transpose(K))) * V, mask::none, 61);
  check_past_exp_range<T>(normalize(causal(exp(Q * transpose(K)))) * V, mask::after_exp, 62);
  check_past_exp_range<T>(normalize(exp(causal(Q * transpose(K)))) * V, mask::before_exp, 63);
  // The mask after the normaliser: each row normalised over every key, then
  // the later keys dropped (exp is made for every key here, not only up to
  // the diagonal as when the mask follows exp directly).
  check_past_exp_range<T>(causal(normalize(exp(Q * transpose(K)))) * V, mask::after_normalize, 65);
  // A scale inside exp and a decayed mask (ALiBi's bias) after it:
  check_past_exp_range<T>(normalize(causal(exp(0.5 * (Q * transpose(K))), decay{0.75})) * V, mask::after_exp, 64,
                          0.5, 0.75);
}

namespace {
// One row-wise op of a chain, as the interpreter applies it to the whole
// N x N matrix: exp, a causal mask (decay^(i−j) kept for j <= i), the row
// normaliser (eps 1e-6), or a scale.
struct row_op {
  enum { exp, mask, normalize, scale } kind;
  double x = 1;  // the mask's decay, the scale's factor
};

// out = ops(Q Kᵀ)·V, each op on the dense matrix in long double.
template <class T>
tensor<double> interpret(tensor<T> const& q, tensor<T> const& k, tensor<T> const& v, std::vector<row_op> const& ops) {
  auto const& sh = q.shape();
  std::size_t const n = sh[2], d = sh[3], m = v.shape()[3];
  tensor<double> out({sh[0], sh[1], n, m});
  using L = long double;
  std::vector<L> s(n * n);
  for (std::size_t b = 0; b < sh[0]; ++b)
    for (std::size_t h = 0; h < sh[1]; ++h) {
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < n; ++j) {
          L dot = 0;
          for (std::size_t c = 0; c < d; ++c) dot += L(q(b, h, i, c)) * L(k(b, h, j, c));
          s[i * n + j] = dot;
        }
      for (row_op const& o : ops)
        for (std::size_t i = 0; i < n; ++i) {
          L sum = 0;
          for (std::size_t j = 0; j < n; ++j) sum += s[i * n + j];
          for (std::size_t j = 0; j < n; ++j) {
            L& e = s[i * n + j];
            switch (o.kind) {
              case row_op::exp: e = std::exp(e); break;
              case row_op::mask: e = j <= i ? e * std::pow(L(o.x), L(i - j)) : 0; break;
              case row_op::normalize: e /= sum + L(1e-6); break;
              case row_op::scale: e *= L(o.x); break;
            }
          }
        }
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t x = 0; x < m; ++x) {
          L o = 0;
          for (std::size_t j = 0; j < n; ++j) o += s[i * n + j] * L(v(b, h, j, x));
          out(b, h, i, x) = double(o);
        }
    }
  return out;
}

// The plan, the other orders and the expression as written against the
// interpreter, over random shapes; scores of moderate size (|s| < 4), so
// exp's relative error stays that of the scores.
template <class T, class Expr>
void check_chain(Expr const& expr, std::vector<row_op> const& ops, std::uint64_t seed) {
  test::rng r{seed};
  double worst = 0;
  for (int trial = 0; trial < test::trials(8); ++trial) {
    std::size_t const b = r.in(1, 2), h = r.in(1, 2), n = r.in(1, 70), d = r.in(1, 10), m = r.in(1, 10);
    auto q = tensor<T>::random({b, h, n, d}, r.next()), k = tensor<T>::random({b, h, n, d}, r.next());
    auto v = tensor<T>::random({b, h, n, m}, r.next());
    for (std::size_t x = 0; x < q.size(); ++x) q.data()[x] *= T(4.0 / double(d));  // |q·k| < 4
    auto want = interpret(q, k, v, ops);
    CONTEXT(b, h, n, d, m);
    // A score's rounding, about √d ε |s| with |s| < 4, becomes exp's relative
    // error; an output sums n such weighted terms (√n ε) and divides once.
    double const scale = std::max(1.0, test::max_abs(want));
    double const bound =
        2 * (4 * std::sqrt(double(d)) + std::sqrt(double(n)) + 4) * std::numeric_limits<T>::epsilon() * scale;
    for (auto const& got : {cpu::evaluate(compile(expr), Q = q, K = k, V = v),
                            cpu::evaluate(compile<order::quadratic>(expr), Q = q, K = k, V = v),
                            cpu::evaluate(expr, Q = q, K = k, V = v)}) {
      double err = max_abs_diff(got, want);
      CHECK(err <= bound);
      worst = std::max(worst, err / bound);
    }
  }
  MESSAGE("largest error / bound: " << worst);
}
}  // namespace

TEST_CASE_TEMPLATE("chains of row-wise ops on the scores = a dense interpreter", T, float, double) {
  using o = row_op;
  auto const S = Q * transpose(K);
  check_chain<T>(normalize(causal(exp(S))) * V, {{o::exp}, {o::mask}, {o::normalize}}, 71);
  check_chain<T>(causal(normalize(exp(S))) * V, {{o::exp}, {o::normalize}, {o::mask}}, 72);
  check_chain<T>(normalize(exp(causal(S))) * V, {{o::mask}, {o::exp}, {o::normalize}}, 73);
  check_chain<T>(causal(exp(S)) * V, {{o::exp}, {o::mask}}, 74);
  check_chain<T>(exp(causal(S)) * V, {{o::mask}, {o::exp}}, 75);
  check_chain<T>(causal(0.5 * exp(S)) * V, {{o::exp}, {o::scale, 0.5}, {o::mask}}, 76);
  check_chain<T>(causal(normalize(causal(exp(S)))) * V, {{o::exp}, {o::mask}, {o::normalize}, {o::mask}}, 77);
  check_chain<T>(normalize(causal(exp(S), decay{0.8})) * V, {{o::exp}, {o::mask, 0.8}, {o::normalize}}, 78);
  check_chain<T>(causal(normalize(exp(0.5 * S)), decay{0.9}) * V,
                 {{o::scale, 0.5}, {o::exp}, {o::normalize}, {o::mask, 0.9}}, 79);
  check_chain<T>(normalize(exp(S)) * V, {{o::exp}, {o::normalize}}, 80);
  check_chain<T>(causal(S) * V, {{o::mask}}, 81);
  check_chain<T>(normalize(2.0 * causal(exp(S))) * V, {{o::exp}, {o::mask}, {o::scale, 2}, {o::normalize}}, 82);
}
