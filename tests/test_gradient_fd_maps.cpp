// Derived gradients against central finite differences in double: softmax,
// scaled and repeated inputs, and the polynomial and random-feature maps
// (with the gradient of their projection W).
#include "gradient_support.hpp"

using namespace gradient_test;

TEST_CASE("gradients equal central differences: softmax, scaled, normalize as written") {
  check_fd(normalize(exp(Q * transpose(K) * 0.5)) * V, 10);
  check_fd(normalize(causal(exp(Q * transpose(K) / 3.0))) * V, 11);
  check_fd(0.25 * causal(phi<elu_plus_one>(Q) * transpose(2.0 * phi<elu_plus_one>(K))) * V, 12);
  // Q and K twice each: contributions to one input add up.
  check_fd(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Q))) * (K * (transpose(K) * V)), 13);
}

// The chains of row-wise ops on the scores whose outputs test_softmax_range.cpp
// checks against a dense interpreter: their gradients, where the products skip
// a masked triangle (kernels::product_zeros), against central differences of
// that output, at lengths past a register tile's rows (8) and to a vector's
// columns (16 floats, 8 doubles).
TEST_CASE("gradients equal central differences: a mask before or after exp, after the normaliser, decayed") {
  auto const S = Q * transpose(K);
  auto const fd = [](auto const& expr, std::uint64_t seed) {
    auto r = check::gradients(expr, {.trials = 4, .max_extent = 19, .seed = seed});
    INFO(r);
    CHECK(r.ok());
  };
  fd(causal(normalize(exp(S))) * V, 14);
  fd(normalize(exp(causal(S))) * V, 15);
  fd(causal(0.5 * exp(S)) * V, 16);
  fd(causal(normalize(causal(exp(S)))) * V, 17);
  fd(causal(normalize(exp(0.5 * S)), decay{0.9}) * V, 18);
  fd(normalize(causal(exp(S), decay{0.8})) * V, 19);
}

TEST_CASE("gradients equal central differences: poly2, favor, random Fourier features") {
  check_fd(causal_plain<poly2>, 20);
  check_fd(full_attn<poly2>, 21);  // normalised: (q·k)² >= 0
  check_fd(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 22);
  check_fd(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * V, 23);
  check_fd(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W))) * V, 24);
}

// A parametric map with grad_z differentiates from its features' values: H =
// ∂L/∂Z once per φ node, ∂X = H·Wᵀ (+ grad_x) and ∂W = Xᵀ·H as products (the
// simple path sums H·Wᵀ as written). The oracle is the same map without
// grad_z, which differentiates row by row through its own vjp and param_vjp
// (each making z again); all three agree to rounding, at lengths and widths
// past the products' tiles and blocks (512 rows) that the finite differences
// above (N ≤ 7) do not reach.
namespace {
template <class Map>
struct rowwise : Map {  // Map without grad_z: the derivation through vjp and param_vjp
  static constexpr std::string_view name = "row by row";
  static void grad_z() = delete;
};
static_assert(concepts::value_differentiable<favor> && concepts::value_differentiable<random_fourier>);
static_assert(concepts::parametric_map<rowwise<favor>> && !concepts::value_differentiable<rowwise<favor>>);
template <class Map>
constexpr auto favor_like = normalize(causal(phi<Map>(Q, W) * transpose(phi<Map>(K, W)))) * V;
template <class Map>
constexpr auto fourier_like = causal(phi<Map>(Q, W) * transpose(phi<Map>(K, W))) * V;
}  // namespace

TEST_CASE("parametric maps: gradients from the features' values equal the map's vjp row by row, and through a tape") {
  struct restore {
    cpu::path was = cpu::current_path();
    ~restore() { cpu::use_path(was); }
  } guard;
  test::rng r{25};
  auto one = [&](auto const& expr, auto const& rows_expr, double w_scale, std::size_t kept) {
    auto const plan = compile<order::linear>(expr);
    auto const rows_plan = compile<order::linear>(rows_expr);
    std::size_t b = r.in(1, 2), h = r.in(1, 2), n = r.next() % 2 ? r.in(1, 60) : r.in(500, 700), d = r.in(1, 40),
                m = r.in(1, 24), f = r.in(1, 40);
    CONTEXT(n, d, m, f);
    auto q = tensor<double>::random({b, h, n, d}, r.next()), k = tensor<double>::random({b, h, n, d}, r.next());
    auto v = tensor<double>::random({b, h, n, m}, r.next()), dout = tensor<double>::random({b, h, n, m}, r.next());
    auto w = tensor<double>::random({b, h, d, f}, r.next());
    for (std::size_t i = 0; i < w.size(); ++i) w.data()[i] *= w_scale;
    cpu::use_path(cpu::path::fast);
    auto fast = cpu::gradient(plan, dout, Q = q, K = k, V = v, W = w);
    auto rows = cpu::gradient(rows_plan, dout, Q = q, K = k, V = v, W = w);
    cpu::use_path(cpu::path::simple);
    auto simple = cpu::gradient(plan, dout, Q = q, K = k, V = v, W = w);
    for (std::size_t i = 0; i < fast.all().size(); ++i) {
      CAPTURE(i);
      double scale = 1 + test::max_abs(rows.all()[i]), bound = test::rounding_bound<double>(double(n * (d + f) * m), scale);
      CHECK(max_abs_diff(fast.all()[i], rows.all()[i]) <= bound);
      CHECK(max_abs_diff(simple.all()[i], rows.all()[i]) <= bound);
    }
    // Through a tape (tests/test_tape.cpp), the values kept are φ(Q; W) and φ(K; W)
    // (each a product with W), and Y where a normaliser reads it; the gradients
    // are the recomputing path's.
    cpu::use_path(cpu::path::fast);
    cpu::tape<double> tp;
    auto out = cpu::evaluate(plan, tp, Q = q, K = k, V = v, W = w);
    CHECK(tp.size() == kept);
    auto taped = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v, W = w);
    for (std::size_t i = 0; i < fast.all().size(); ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(taped.all()[i], fast.all()[i]) <= 1e-12 * (1 + test::max_abs(fast.all()[i])));
    }
  };
  for (int trial = 0; trial < test::trials(4); ++trial) {
    one(favor_like<favor>, favor_like<rowwise<favor>>, 0.3, 3);
    one(fourier_like<random_fourier>, fourier_like<rowwise<random_fourier>>, 1.0, 2);
  }
}
