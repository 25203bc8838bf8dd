// The backend-neutral layer: schedules (steps, fused groups, common
// subexpressions, scan indices, last uses) as compile-time tables, select
// resolution, and bindings of a tensor type the DSL core does not know (a
// stand-in for a device tensor).
#include <doctest/doctest.h>

#include <array>
#include <lina/bind.hpp>
#include <lina/lina.hpp>
#include <lina/schedule.hpp>
#include <lina/state.hpp>
#include <string>
#include <vector>
#include "support.hpp"

using namespace lina;

namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 8>;
constexpr auto M = dim<"M", 4>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;

template <class S, std::size_t J>
std::string step_text(auto const& plan) {
  return to_string(S::template node_at<J>(plan));
}
template <class P>
std::vector<std::string> steps_of(P const& plan) {
  using S = schedule_of<P>;
  std::vector<std::string> out;
  [&]<std::size_t... J>(std::index_sequence<J...>) { (out.push_back(step_text<S, J>(plan)), ...); }(
      std::make_index_sequence<S::size>{});
  return out;
}

// ---- the causal linear plan: φQ, φK, [V|1], one fused scan, rowdiv ----------------
constexpr auto linear = compile<order::linear>(attn);
using linear_schedule = schedule_of<std::remove_cvref_t<decltype(linear)>>;
static_assert(linear_schedule::size == 5);
static_assert(linear_schedule::is_prefix_scan<3> && linear_schedule::scan_index[3] == 0);
static_assert(linear_schedule::prefix_scans == 1);
// φQ, φK and [V|1] are made as the scan loads them, rowdiv finishes its rows:
// one pass, the scan's turn (runs_in), no N-row temporary
static_assert(linear_schedule::absorbed_by[0] == 3 && linear_schedule::absorbed_by[1] == 3 &&
              linear_schedule::absorbed_by[2] == 3);
static_assert(linear_schedule::emits[3] == 4);
static_assert(linear_schedule::runs_in[0] == 3 && linear_schedule::runs_in[4] == 3 &&
              linear_schedule::runs_in[3] == 3);
static_assert(linear_schedule::last_use[0] == 3 && linear_schedule::last_use[3] == 3);  // reads at the scan's turn
static_assert(linear_schedule::last_use[4] == linear_schedule::size);  // the output
static_assert(linear_schedule::outputs::size == 1);

// ---- stacked layers: the inner scan is state 0, the outer state 1 ------------------
constexpr auto K2 = input<"K2">(N, D);
constexpr auto V2 = input<"V2">(N, M);
constexpr auto Vd = input<"V">(N, D);
constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * Vd;
constexpr auto layer2 = normalize(causal(phi<poly2>(layer1) * transpose(phi<poly2>(K2)))) * V2;
using stacked = std::remove_cvref_t<decltype(compile<order::linear>(layer2))>;
static_assert(schedule_of<stacked>::prefix_scans == 2);
static_assert(std::is_same_v<typename detail::type_at_t<0, state_scans<stacked>>::shape::b,
                             plus_one<std::remove_cvref_t<decltype(D)>>>);  // layer 1: [V|1], D+1 columns
static_assert(std::is_same_v<typename detail::type_at_t<1, state_scans<stacked>>::shape::b,
                             plus_one<std::remove_cvref_t<decltype(M)>>>);  // layer 2: [V2|1]

// ---- the backward bundle: the recomputed forward scan is one step ------------------
constexpr auto backward = as_bundle(gradient(linear));
using backward_schedule = schedule_of<std::remove_cvref_t<decltype(backward)>>;
static_assert(backward_schedule::outputs::size == 3);  // ∂Q, ∂K, ∂V

// ---- fused groups: a chain of row-wise ops is one pass ----------------------------
// softmax: exp(s·(Q·Kᵀ)) - the scale is made row by row inside exp's pass.
constexpr auto softmax = normalize(exp(Q * transpose(K) / 2.0)) * V;
using softmax_schedule = schedule_of<std::remove_cvref_t<decltype(compile(softmax))>>;

}  // namespace

TEST_CASE("a schedule lists the steps of a plan in evaluation order, the scan fused") {
  CHECK(steps_of(linear) == std::vector<std::string>{
                                "φ[elu+1](Q)", "φ[elu+1](K)", "[V|1]",
                                "contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1]))",
                                "rowdiv(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])))"});
  // stacked: layer 1's scan before layer 2's, each numbered by its place
  auto stacked_steps = steps_of(compile<order::linear>(layer2));
  using S = schedule_of<stacked>;
  std::vector<std::size_t> scans;
  for (std::size_t j = 0; j < S::size; ++j)
    if (S::scan_index[j] != sched::none) scans.push_back(j);
  REQUIRE(scans.size() == 2);
  CHECK(S::scan_index[scans[0]] == 0);
  CHECK(S::scan_index[scans[1]] == 1);
  CHECK(stacked_steps[scans[0]].find("φ[poly2]") == std::string::npos);  // the inner (elu+1) scan is state 0
  CHECK(stacked_steps[scans[1]].find("φ[poly2]") != std::string::npos);
}

TEST_CASE("common subexpressions: value-free ones are one step, valued ones name a twin") {
  auto steps = steps_of(backward);
  std::string const forward_scan = "contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1]))";
  CHECK(std::count(steps.begin(), steps.end(), forward_scan) == 1);
  CHECK(std::count(steps.begin(), steps.end(), "φ[elu+1](Q)") == 1);
  // rowdiv′(…, dout) carries an eps: each occurrence is a step, the later ones
  // naming the first as their twin, shared when the values agree at run time
  using S = backward_schedule;
  std::size_t twins = 0;
  for (std::size_t j = 0; j < S::size; ++j)
    if (S::twin[j] != sched::none) {
      ++twins;
      CHECK(steps[S::twin[j]] == steps[j]);
      CHECK(S::last_use[S::twin[j]] >= S::last_use[j]);  // the shared result lives long enough
    }
  CHECK(twins == 2);
}

TEST_CASE("twin copies of a chain of row-wise steps fuse as the first copy does, and share its last step") {
  // The softmax backward recomputes causal(exp(0.125·(Q·Kᵀ))) for each of its
  // readers: the scale carries a value, so each copy's steps are twins of the
  // first's. Each copy is one fused group (not three passes over N × N), and
  // only the groups' last steps are shared.
  constexpr auto softmax = compile(normalize(causal(exp(Q * transpose(K) * 0.125))) * V);
  constexpr auto bundle = as_bundle(backward_of(softmax));
  using S = schedule_of<std::remove_cvref_t<decltype(bundle)>>;
  auto steps = steps_of(bundle);
  std::size_t groups = 0;
  for (std::size_t j = 0; j < S::size; ++j) {
    if (steps[j] != "causal(exp(0.125·(Q·Kᵀ)))") continue;
    CAPTURE(j);
    ++groups;
    REQUIRE(S::chain_start[j] + 2 == j);  // the scale, exp and mask in one pass
    CHECK(S::runs_in[S::chain_start[j]] == j);
    if (S::twin[j] != sched::none) {
      CHECK(S::twin[S::chain_start[j]] == S::chain_start[S::twin[j]]);  // absorbed twins: never shared themselves
      CHECK(S::last_use[S::twin[j]] >= S::last_use[j]);
    }
  }
  CHECK(groups >= 2);
}

TEST_CASE("the backward's φ′ steps take the rows of the scan they read as it finishes them") {
  using S = backward_schedule;
  auto steps = steps_of(backward);
  std::size_t emitted = 0;
  for (std::size_t j = 0; j < S::size; ++j) {
    if (steps[j].rfind("φ′", 0) != 0) continue;  // φ′(X)⊙contract(…)
    std::size_t scan = S::own_turn[j];
    REQUIRE(scan < j);
    CHECK(S::emits[scan] == j);
    CHECK(steps[scan].rfind("contract(", 0) == 0);
    CHECK((S::runs_in[j] == scan || S::dual_of[S::runs_in[j]] == scan));  // in its scan's turn, maybe paired
    ++emitted;
  }
  CHECK(emitted == 2);  // ∂Q's and ∂K's; ∂V's scan result is an output's view (dropcol)
}

TEST_CASE("the backward's ∂K and ∂V suffix scans run as one scan (transposed running sums)") {
  using S = backward_schedule;
  auto steps = steps_of(backward);
  std::size_t pairs = 0;
  for (std::size_t k = 0; k < S::size; ++k) {
    std::size_t j = S::dual_of[k];
    if (j == sched::none) continue;
    ++pairs;
    CHECK(j < k);
    CHECK(S::runs_in[j] == k);  // j's turn is k's
    CHECK(S::runs_in[k] == k);
    CHECK(steps[j].find("suffix(") != std::string::npos);
    CHECK(steps[k].find("suffix(") != std::string::npos);
    // K's state Σ φ(Q)⊗t is the transpose of J's Σ t⊗φ(Q)
    CHECK(steps[k].rfind("contract(φ[elu+1](K), suffix(φ[elu+1](Q)⊗", 0) == 0);
    CHECK(steps[j].rfind("contract([V|1], suffix(", 0) == 0);
  }
  CHECK(pairs == 1);
  // prefix scans (whose running sums are a plan's state) are never paired;
  // every scan has its place in a state (a chained backward starts it there)
  constexpr auto prefix = []<std::size_t... J>(std::index_sequence<J...>) {
    return std::array<bool, S::size>{S::template is_prefix_scan<J>...};
  }(std::make_index_sequence<S::size>{});
  for (std::size_t k = 0; k < S::size; ++k)
    if (std::size_t const j = S::dual_of[k]; j != sched::none) {
      CHECK((!prefix[k] && !prefix[j]));
      CHECK((S::scan_index[k] != sched::none && S::scan_index[j] != sched::none));
    }
}

TEST_CASE("a chain of row-wise steps is one fused group") {
  using S = softmax_schedule;
  auto steps = steps_of(compile(softmax));
  std::size_t scale = std::find(steps.begin(), steps.end(), "0.5·(Q·Kᵀ)") - steps.begin();
  REQUIRE(scale < S::size);
  std::size_t exp_step = S::absorbed_by[scale];
  REQUIRE(exp_step < S::size);
  CHECK(steps[exp_step] == "exp(0.5·(Q·Kᵀ))");
  CHECK(S::chain_start[exp_step] == scale);
  // the product feeding the group is not row-wise: it is its own step
  CHECK(S::absorbed_by[scale - 1] == sched::none);
  // rowdiv reads a product: a group of one
  CHECK(S::chain_start[S::size - 1] == S::size - 1);
}

struct extents {  // every dimension at n
  std::size_t n;
  template <class X>
  std::size_t get() const {
    return n;
  }
};

TEST_CASE("selects are resolved once per call: every select with one key and threshold takes one branch") {
  auto plan = compile(attn);
  auto [t, count] = select_thresholds<decltype(plan)>();
  REQUIRE(count == 1);
  std::string small, large;
  with_resolved_plan(plan, extents{t[0] - 1}, [&](auto const& p) {
    static_assert(!has_select<std::remove_cvref_t<decltype(p)>>());
    small = to_string(p);
  });
  with_resolved_plan(plan, extents{t[0]}, [&](auto const& p) { large = to_string(p); });
  CHECK(small == to_string(compile<order::quadratic>(attn)));
  CHECK(large == to_string(compile<order::linear>(attn)));
  // the backward bundle has a select per gradient, all alike: one decision
  static_assert(selects_of<decltype(as_bundle(gradient(plan)))>::type::size == 1);
}

// selects_of walks a tree's structure, each subtree once, so a deep backward
// resolves: a three-layer stack whose middle layer reads the lowest twice has
// more nodes, repeats included, than the compiler's default template depth
// (900) — a fold over every node stopped compiling there (cpu::gradient of
// this stack did).
TEST_CASE("selects of a three-layer stack's backward resolve within the default template depth") {
  constexpr auto K2 = input<"K2">(N, D);
  constexpr auto V3 = input<"V3">(N, M);
  constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * input<"V1">(N, D);
  constexpr auto two = normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * layer1;
  constexpr auto three = normalize(causal(phi<elu_plus_one>(two) * transpose(phi<elu_plus_one>(K)))) * V3;
  using G = decltype(as_bundle(gradient(compile<order::linear>(three))));
  static_assert(lina::detail::all_nodes<G>::type::size > 900);
  static_assert(selects_of<G>::type::size == 0);
}

// A tensor type lina's core has never heard of: bindings take it through
// view_of(), found by argument-dependent lookup, as a device backend's would.
namespace elsewhere {
template <class T>
struct remote_view {
  using element_type_ = T;
  T* ptr = nullptr;
  shape4 dims{};
  strides4 steps{};
  T* data() const { return ptr; }
  shape4 const& shape() const { return dims; }
  strides4 const& strides() const { return steps; }
};
struct remote_tensor {
  shape4 dims;
  std::vector<float> storage = std::vector<float>(dims[0] * dims[1] * dims[2] * dims[3]);
};
inline remote_view<float const> view_of(remote_tensor const& t) {
  return {t.storage.data(), t.dims, tensor_view<float>::contiguous_strides(t.dims)};
}
}  // namespace elsewhere

TEST_CASE("bindings accept a backend's own tensor type without changes to the core") {
  elsewhere::remote_tensor q{{2, 3, 10, 8}}, k{{2, 3, 10, 8}}, v{{2, 3, 10, 4}}, bad{{2, 3, 11, 4}};
  auto bound = bind<decltype(linear)>(Q = q, K = k, V = v);
  static_assert(std::is_same_v<decltype(bound)::view_type, elsewhere::remote_view<float const>>);
  CHECK(bound.batch == 2);
  CHECK(bound.heads == 3);
  CHECK(bound.table.get<std::remove_cvref_t<decltype(N)>>() == 10);
  CHECK(result_shape<decltype(linear)>(bound) == shape4{2, 3, 10, 4});
  test::expect_shape_error([&] { bind<decltype(linear)>(Q = q, K = k, V = bad); }, "V", "N", 11, 10);
}

TEST_CASE("a state's checks live in the neutral layer") {
  elsewhere::remote_tensor q{{1, 2, 5, 8}}, v{{1, 2, 5, 4}}, q3{{1, 3, 5, 8}}, v3{{1, 3, 5, 4}};
  state_info info;
  CHECK(info.unbound());
  CHECK(info.prepare(linear, bind<decltype(linear)>(Q = q, K = q, V = v)));  // sized now
  CHECK(info.scans() == 1);
  CHECK(info.scan(0).a == 8);
  CHECK(info.scan(0).b == 5);
  CHECK_FALSE(info.prepare(linear, bind<decltype(linear)>(Q = q, K = q, V = v)));
  CHECK_THROWS_AS(info.prepare(linear, bind<decltype(linear)>(Q = q3, K = q3, V = v3)), shape_error);
  constexpr auto relu_plan = compile<order::linear>(normalize(causal(phi<relu>(Q) * transpose(phi<relu>(K)))) * V);
  CHECK_THROWS_WITH_AS(info.prepare(relu_plan, bind<decltype(relu_plan)>(Q = q, K = q, V = v)),
                       doctest::Contains("φ[elu+1]"), state_error);
}
