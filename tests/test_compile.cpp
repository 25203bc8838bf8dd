// compile(): which plan an expression becomes, as compile-time tables
// (expression -> expected plan type, and cases where a rule must not fire),
// the printed forms, and the cost model's numbers.
#include <doctest/doctest.h>

#include <lina/cpu/cost_model.hpp>
#include <lina/lina.hpp>
#include <lina/state.hpp>
#include <string>
#include <type_traits>

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 32>;
constexpr auto M = dim<"M", 16>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto fQ = phi<elu_plus_one>(Q);
constexpr auto fK = phi<elu_plus_one>(K);
constexpr auto causal_attn = normalize(causal(fQ * transpose(fK))) * V;
constexpr auto full_attn = normalize(fQ * transpose(fK)) * V;

// The plan vocabulary spelled out, to state expected plans as types.
using Qt = std::remove_cvref_t<decltype(Q)>;
using Kt = std::remove_cvref_t<decltype(K)>;
using Vt = std::remove_cvref_t<decltype(V)>;
using fQt = node<op::phi<elu_plus_one>, Qt>;
using fKt = node<op::phi<elu_plus_one>, Kt>;
using V1 = node<op::append_ones, Vt>;
template <class A, class B>
using mul = node<op::product, A, B>;
template <class A, class B, class C>
using prefix_scan_of = node<op::contract_rows, A, node<op::prefix_scan, node<op::outer_rows, B, C>>>;
template <class X>
using rowdiv = node<op::row_divide, X>;
using N_t = std::remove_cvref_t<decltype(N)>;

template <class P>
constexpr bool is_linear = !has_square<P, N_t>();

// ---- table: expression -> plan ------------------------------------------------
using causal_linear = rowdiv<prefix_scan_of<fQt, fKt, V1>>;
using causal_quadratic = rowdiv<mul<node<op::causal, mul<fQt, node<op::transpose, fKt>>>, V1>>;
static_assert(std::is_same_v<decltype(compile<order::linear>(causal_attn)), causal_linear>);
static_assert(std::is_same_v<decltype(compile<order::quadratic>(causal_attn)), causal_quadratic>);
// N dynamic: both plans, one run-time choice.
static_assert(std::is_same_v<decltype(compile(causal_attn)),
                             rowdiv<node<op::select<N_t, select_thresholds<decltype(compile(causal_attn))>().first[0]>,
                                         mul<node<op::causal, mul<fQt, node<op::transpose, fKt>>>, V1>,
                                         prefix_scan_of<fQt, fKt, V1>>>>);

// Non-causal: reassociation alone, φQ·(φKᵀ·[V|1]).
using full_linear = rowdiv<mul<fQt, mul<node<op::transpose, fKt>, V1>>>;
using full_quadratic = rowdiv<mul<mul<fQt, node<op::transpose, fKt>>, V1>>;
static_assert(std::is_same_v<decltype(compile<order::linear>(full_attn)), full_linear>);
static_assert(std::is_same_v<decltype(compile<order::quadratic>(full_attn)), full_quadratic>);

// Written right-associated, still reordered both ways.
constexpr auto right_assoc = fQ * (transpose(fK) * V);
static_assert(std::is_same_v<decltype(compile<order::quadratic>(right_assoc)),
                             mul<mul<fQt, node<op::transpose, fKt>>, Vt>>);

// Transposes are pushed to the leaves: (φK·φQᵀ)ᵀ·V is φQ·φKᵀ·V.
constexpr auto transposed = transpose(fK * transpose(fQ)) * V;
static_assert(std::is_same_v<decltype(compile<order::linear>(transposed)), mul<fQt, mul<node<op::transpose, fKt>, Vt>>>);

// Scale factors are hoisted above the plan, whatever their place.
constexpr auto scaled = causal((0.5 * fQ) * transpose(2.0 * fK)) * V;
static_assert(std::is_same_v<decltype(compile<order::linear>(scaled)), node<op::scale, prefix_scan_of<fQt, fKt, Vt>>>);

// ---- must not fire --------------------------------------------------------------
// exp has no finite feature map: quadratic whatever the length.
constexpr auto NL = dim<"N", 65536>;
constexpr auto QL = input<"Q">(NL, D);
constexpr auto KL = input<"K">(NL, D);
constexpr auto VL = input<"V">(NL, M);
constexpr auto softmax_long = normalize(exp((QL * transpose(KL)) / 5.66)) * VL;
static_assert(contains_op<decltype(compile(softmax_long)), op::exp>());
static_assert(!contains_op<decltype(compile(softmax_long)), op::prefix_scan>());
static_assert(!has_select<decltype(compile(normalize(exp(Q * transpose(K))) * V))>());
// causal(exp(...)) does not match causal(A·B): no scan.
static_assert(!contains_op<decltype(compile(causal(exp(QL * transpose(KL))) * VL)), op::prefix_scan>());
// A bare product has nothing to reassociate.
static_assert(std::is_same_v<decltype(compile(Q * transpose(K))), mul<Qt, node<op::transpose, Kt>>>);
// Short static N: the quadratic order is cheaper, so the scan does not fire.
constexpr auto NS = dim<"N", 8>;
constexpr auto DS = dim<"D", 64>;
constexpr auto QS = input<"Q">(NS, DS);
constexpr auto KS = input<"K">(NS, DS);
constexpr auto VS = input<"V">(NS, DS);
static_assert(!contains_op<decltype(compile(causal(QS * transpose(KS)) * VS)), op::prefix_scan>());
static_assert(!has_select<decltype(compile(causal(QS * transpose(KS)) * VS))>());
// Long static N: decided at compile time, no run-time choice.
constexpr auto QB = input<"Q">(NL, DS);
constexpr auto KB = input<"K">(NL, DS);
constexpr auto VB = input<"V">(NL, DS);
static_assert(contains_op<decltype(compile(causal(QB * transpose(KB)) * VB)), op::prefix_scan>());
static_assert(!has_select<decltype(compile(causal(QB * transpose(KB)) * VB))>());

// A longer chain: φQ·φKᵀ·V·W with W (M x P) - every product is bracketed by cost.
constexpr auto P64 = dim<"P", 64>;
constexpr auto W = input<"W">(M, P64);
static_assert(is_linear<decltype(compile<order::linear>(fQ * transpose(fK) * V * W))>);
// causal(A·Bᵀ)·V·W: the scan fires on V·W or on V, whichever is cheaper (V: 16 columns).
static_assert(contains_op<decltype(compile<order::linear>(causal(fQ * transpose(fK)) * V * W)), op::prefix_scan>());

}  // namespace

TEST_CASE("plans print in the plan vocabulary") {
  CHECK(to_string(causal_attn) == "normalize(causal(φ[elu+1](Q)·φ[elu+1](K)ᵀ))·V");
  CHECK(to_string(compile<order::linear>(causal_attn)) == "rowdiv(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])))");
  CHECK(to_string(compile<order::quadratic>(causal_attn)) == "rowdiv(causal(φ[elu+1](Q)·φ[elu+1](K)ᵀ)·[V|1])");
  CHECK(to_string(compile(full_attn)) ==
        "rowdiv((N < 23 ? (φ[elu+1](Q)·φ[elu+1](K)ᵀ)·[V|1] : φ[elu+1](Q)·(φ[elu+1](K)ᵀ·[V|1])))");
  CHECK(to_string(compile(causal_attn)) ==
        "rowdiv((N < 23 ? causal(φ[elu+1](Q)·φ[elu+1](K)ᵀ)·[V|1] : contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1]))))");
  CHECK(fmt::format("{}", compile<order::linear>(scaled)) == "1·contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗V))");
}

// Two plans that differ in their map, eps or scale never print alike (a
// state used with the wrong plan names both plans in its error).
TEST_CASE("printed plans show the map, a non-default eps and exact scale factors") {
  constexpr auto poly = normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V;
  CHECK(to_string(compile<order::linear>(poly)) == "rowdiv(contract(φ[poly2](Q), prefix(φ[poly2](K)⊗[V|1])))");
  CHECK(to_string(compile<order::linear>(poly)) != to_string(compile<order::linear>(causal_attn)));
  constexpr auto eps = normalize(causal(fQ * transpose(fK)), 1e-3) * V;
  CHECK(to_string(compile<order::linear>(eps)) ==
        "rowdiv(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])); eps=0.001)");
  CHECK(to_string(normalize(fQ * transpose(fK), 0.25)) == "normalize(φ[elu+1](Q)·φ[elu+1](K)ᵀ; eps=0.25)");
  CHECK(to_string(Q / 3.0) == "0.3333333333333333·Q");
  CHECK(to_string((1.0 / 3.0 + 1e-16) * Q) != to_string(Q / 3.0));
  constexpr auto F = dim<"F">;
  constexpr auto Wf = input<"W">(D, F);
  CHECK(to_string(phi<favor>(Q, Wf)) == "φ[favor](Q; W)");
}

// The matcher is sound: a variable used twice matches equal subtrees only.
namespace matcher {
using namespace lina::rewrite;
constexpr auto pattern = x_ * transpose(x_);
template <class E>
constexpr bool matches(E const& e) {
  return decltype(hana::is_just(match(pattern, e)))::value;
}
static_assert(matches(Q * transpose(Q)));
static_assert(!matches(Q * transpose(K)));
static_assert(!matches(fQ * transpose(fK)));
static_assert(matches(fQ * transpose(fQ)));
// Same type, values that may differ at run time: not provably equal, no match.
static_assert(!matches((2.0 * Q) * transpose(3.0 * Q)));
}  // namespace matcher

TEST_CASE("estimate counts the plan's flops and bytes") {
  double n = 1000, d = 32, m1 = 17;
  auto lin = estimate(compile<order::linear>(causal_attn), N = 1000);
  // φQ, φK: n d each; outer and prefix: n d (m+1) each; contract: 2 n d (m+1); rowdiv: n m.
  CHECK(lin.flops == doctest::Approx(2 * n * d + 4 * n * d * m1 + n * 16));
  // φQ, φK, [V|1], the scan's state, the contraction's result, rowdiv's result (fp32).
  CHECK(lin.bytes == doctest::Approx(4 * (2 * n * d + n * m1 + d * m1 + n * m1 + n * 16)));
  auto quad = estimate<double>(compile<order::quadratic>(causal_attn), N = 1000);
  CHECK(quad.flops == doctest::Approx(2 * n * d + 2 * n * d * n + 2 * n * n * m1 + n * 16));
  CHECK(quad.bytes == doctest::Approx(8 * (2 * n * d + n * n + n * m1 + n * m1 + n * 16)));
  // the fused scan's share (outer, prefix, contract), which cpu::cost_model weighs apart
  CHECK(lin.scan_flops == doctest::Approx(4 * n * d * m1));
  CHECK(quad.scan_flops == 0);
  // the products a causal mask half zeroes: φQ·φKᵀ (the mask reads it) and causal(…)·[V|1]
  CHECK(quad.masked_flops == doctest::Approx(2 * n * d * n + 2 * n * n * m1));
  CHECK(lin.masked_flops == 0);
  auto full = estimate(compile<order::quadratic>(normalize(fQ * transpose(fK)) * V), N = 1000);
  CHECK(full.masked_flops == 0);
}

TEST_CASE("cpu::cost_model weighs scan flops and masked products apart, and the non-causal crossover stays") {
  auto [counting, c1] = select_thresholds<decltype(compile(causal_attn))>();
  auto [cpu_model, c2] = select_thresholds<decltype(compile<order::automatic, cpu::cost_model>(causal_attn))>();
  REQUIRE(c1 == 1);
  REQUIRE(c2 == 1);
  // The masked products' skipped half outweighs the scan's lower rate per flop:
  // the quadratic order stays cheaper to a longer N than the plain count says.
  CHECK(cpu_model[0] > counting[0]);
  auto w = [](auto const& p, std::size_t n) { return cpu::cost_model::weight(estimate(p, N = n)); };
  auto lin = compile<order::linear>(causal_attn);
  auto quad = compile<order::quadratic>(causal_attn);
  CHECK(w(quad, cpu_model[0] - 1) <= w(lin, cpu_model[0] - 1));
  CHECK(w(lin, cpu_model[0]) < w(quad, cpu_model[0]));
  constexpr auto full = normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K))) * V;
  auto [counting_full, c3] = select_thresholds<decltype(compile(full))>();
  auto [cpu_full, c4] = select_thresholds<decltype(compile<order::automatic, cpu::cost_model>(full))>();
  REQUIRE(c3 == 1);
  REQUIRE(c4 == 1);
  CHECK(cpu_full[0] == counting_full[0]);  // no scan in the non-causal orders
}

TEST_CASE("the select threshold is where the cost model's preference flips") {
  auto plan = compile(causal_attn);
  auto [t, count] = select_thresholds<decltype(plan)>();
  REQUIRE(count == 1);
  auto w = [](auto const& p, std::size_t n) { return default_cost_model::weight(estimate(p, N = n)); };
  auto lin = compile<order::linear>(causal_attn);
  auto quad = compile<order::quadratic>(causal_attn);
  CHECK(w(quad, t[0] - 1) <= w(lin, t[0] - 1));
  CHECK(w(lin, t[0]) < w(quad, t[0]));
  for (std::size_t n : {1u, 2u, 5u, 100u, 1000u, 100000u})
    CHECK(estimate(plan, N = n).flops == (n < t[0] ? estimate(quad, N = n).flops : estimate(lin, N = n).flops));
}

TEST_CASE("the sequence dimension comes from the structure, not from counting names") {
  CHECK(std::is_same_v<sequence_dim<decltype(causal_attn)>, N_t>);
  constexpr auto X = input<"X">(M, D);
  CHECK(std::is_same_v<sequence_dim<decltype(X * transpose(X) * W)>, std::remove_cvref_t<decltype(M)>>);

  // FAVOR with d_v = d_k: D is named by Q, K, V and W (five times), N three
  // times; the causal mask still says N, so N gets the run-time choice.
  constexpr auto F = dim<"F">;
  constexpr auto Dd = dim<"D">;
  constexpr auto Qf = input<"Q">(N, Dd);
  constexpr auto Kf = input<"K">(N, Dd);
  constexpr auto Vf = input<"V">(N, Dd);
  constexpr auto Wf = input<"W">(Dd, F);
  constexpr auto favor_causal = normalize(causal(phi<favor>(Qf, Wf) * transpose(phi<favor>(Kf, Wf)))) * Vf;
  CHECK(std::is_same_v<sequence_dim<decltype(favor_causal)>, N_t>);
  CHECK(has_select<decltype(compile(favor_causal))>());
  CHECK(std::is_same_v<scanned_dim<decltype(compile<order::linear>(favor_causal))>, N_t>);
  // Non-causal: the square similarity φQ·φKᵀ says N.
  constexpr auto favor_full = normalize(phi<favor>(Qf, Wf) * transpose(phi<favor>(Kf, Wf))) * Vf;
  CHECK(std::is_same_v<sequence_dim<decltype(favor_full)>, N_t>);
  CHECK(has_select<decltype(compile(favor_full))>());
  // Written in linear order there is no similarity; φKᵀ·V sums over N.
  constexpr auto elu_linear = phi<elu_plus_one>(Qf) * (transpose(phi<elu_plus_one>(Kf)) * Vf);
  CHECK(std::is_same_v<sequence_dim<decltype(elu_linear)>, N_t>);
  constexpr auto favor_linear = phi<favor>(Qf, Wf) * (transpose(phi<favor>(Kf, Wf)) * Vf);
  CHECK(std::is_same_v<sequence_dim<decltype(favor_linear)>, N_t>);
  CHECK(has_square<decltype(compile<order::quadratic>(favor_linear)), N_t>());
  // Two sums over different token dimensions: the user names the sequence.
  constexpr auto L = dim<"L">;
  constexpr auto C = input<"C">(L, Dd);
  constexpr auto E = input<"E">(L, P64);
  constexpr auto two_sums = transpose(Qf) * Vf * transpose(C) * E;
  CHECK(std::is_void_v<sequence_dim<decltype(two_sums)>>);
}
