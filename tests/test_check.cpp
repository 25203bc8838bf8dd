// lina::check, the checks users run on their own variants: they pass on
// lina's maps, and they catch a wrong derivative or vjp, a NaN, and say where.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <lina/check.hpp>
#include <lina/lina.hpp>
#include <set>
#include <stdexcept>
#include <string>

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);

template <class Map>
constexpr auto attention = normalize(causal(phi<Map>(Q) * transpose(phi<Map>(K)))) * V;

// What a map's author gets wrong, chosen at run time so that one map type
// (one instantiation of the checks) serves the control and each mistake.
enum class mistake { none, forgot_a_factor, nan_for_negatives };
inline mistake made = mistake::none;

// φ(x) = x² + 1; its derivative 2x, or x (the 2 forgotten), or NaN for x < 0
// (as a log would give).
struct square_plus_one {
  static constexpr std::string_view name = "square_plus_one";
  template <class T>
  static T value(T x) {
    return x * x + 1;
  }
  template <class T>
  static T derivative(T x) {
    if (made == mistake::forgot_a_factor) return x;
    if (made == mistake::nan_for_negatives && x < 0) return std::numeric_limits<T>::quiet_NaN();
    return 2 * x;
  }
};
// A row map, features(d) = d + 1: the row and 1 + its squared norm; the
// mistake: the vjp drops the last feature's term.
struct with_norm {
  static constexpr std::string_view name = "with_norm";
  static constexpr std::size_t features(std::size_t d) { return d + 1; }
  template <class T>
  static void apply(T const* x, std::size_t d, T* out) {
    T s = 1;
    for (std::size_t i = 0; i < d; ++i) out[i] = x[i], s += x[i] * x[i];
    out[d] = s;
  }
  template <class T>
  static void vjp(T const* x, std::size_t d, T const* g, T* dx) {
    for (std::size_t i = 0; i < d; ++i) dx[i] = g[i] + (made == mistake::none ? 2 * x[i] * g[d] : T(0));
  }
};
struct mistake_made {  // sets `made` for a scope
  explicit mistake_made(mistake m) { made = m; }
  ~mistake_made() { made = mistake::none; }
};

bool has(check::report const& r, std::string const& quantity, std::string const& order) {
  for (auto const& f : r.findings)
    if (f.quantity == quantity && f.order == order) return true;
  return false;
}
check::finding const& find(check::report const& r, std::string const& quantity, std::string const& order) {
  for (auto const& f : r.findings)
    if (f.quantity == quantity && f.order == order) return f;
  throw std::logic_error("no such finding");
}
}  // namespace

TEST_CASE("check: right maps pass with every input and order reported, and a wrong derivative or vjp fails") {
  auto g = check::gradients(attention<square_plus_one>);
  INFO(g);
  CHECK(g.ok());
  CHECK(g.findings.size() == 3 * 4);  // ∂Q, ∂K, ∂V x (as written, automatic, quadratic, linear)
  for (char const* order : {"as written", "order::automatic", "order::quadratic", "order::linear"})
    for (char const* q : {"∂Q", "∂K", "∂V"}) CHECK(has(g, q, order));
  for (auto const& f : g.findings) CHECK(f.error <= 1e-6);
  auto o = check::orderings(attention<square_plus_one>);
  INFO(o);
  CHECK(o.ok());
  CHECK(o.findings.size() == 3);
  for (auto const& f : o.findings) CHECK(f.error < 1e-12);  // double rounding, not a tolerance's worth

  SUBCASE("the derivative forgot a factor") {
    mistake_made m(mistake::forgot_a_factor);
    auto w = check::gradients(attention<square_plus_one>);
    INFO(w);
    CHECK_FALSE(w.ok());
    for (char const* order : {"as written", "order::automatic", "order::quadratic", "order::linear"}) {
      CHECK_FALSE(w.passes(find(w, "∂Q", order)));
      CHECK_FALSE(w.passes(find(w, "∂K", order)));
      CHECK(w.passes(find(w, "∂V", order)));  // V does not go through φ′
    }
    auto const& worst = w.worst();
    CHECK((worst.quantity == "∂Q" || worst.quantity == "∂K"));
    CHECK(worst.error == doctest::Approx(std::abs(worst.got - worst.want) / (1 + std::abs(worst.want))));
    CHECK(worst.error > 1e-3);
    std::string const s = w.str();
    CHECK(s.find("FAILED") != std::string::npos);
    CHECK(s.find("x ∂Q") != std::string::npos);
    CHECK(s.find(worst.extents) != std::string::npos);
    CHECK(check::orderings(attention<square_plus_one>).ok());  // the forward is right
  }
  SUBCASE("the derivative is NaN for negative inputs") {
    mistake_made m(mistake::nan_for_negatives);
    auto w = check::gradients(attention<square_plus_one>);
    INFO(w);
    CHECK_FALSE(w.ok());
    CHECK(std::isnan(w.worst().error));
    CHECK(w.str().find("nan") != std::string::npos);
  }
  SUBCASE("a row map's vjp drops a term") {
    auto right = check::gradients(attention<with_norm>, {.trials = 2});
    INFO(right);
    CHECK(right.ok());
    mistake_made m(mistake::forgot_a_factor);
    auto w = check::gradients(attention<with_norm>, {.trials = 2});
    INFO(w);
    CHECK_FALSE(w.ok());
    CHECK_FALSE(w.passes(find(w, "∂K", "order::linear")));
  }
}

TEST_CASE("check: recurrent steps, two chained blocks and their joined gradients = the expression as written, a cut at 0 and N included") {
  // Double sums row by row in the same order in steps, blocks and one pass:
  // the same bits as the linear plan, to rounding of the as-written product;
  // the joined gradients to rounding in double.
  std::set<std::string> cuts;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    auto r = check::recurrent(attention<square_plus_one>, {.trials = 1, .seed = seed});
    INFO(r);
    CHECK(r.ok());
    REQUIRE(r.findings.size() == 5);
    CHECK(r.findings[0].quantity == "out (steps)");
    CHECK(r.findings[1].quantity == "out (two blocks)");
    for (char const* q : {"∂Q (two blocks)", "∂K (two blocks)", "∂V (two blocks)"}) CHECK(has(r, q, "order::automatic"));
    for (auto const& f : r.findings) CHECK(f.error < 1e-12);
    auto const& e = r.findings[1].extents;
    auto const n = std::stoul(e.substr(e.find(" N=") + 3)), cut = std::stoul(e.substr(e.find("cut at ") + 7));
    CHECK(cut <= n);
    cuts.insert(cut == 0 ? "0" : cut == n ? "N" : "inside");
  }
  CHECK(cuts.size() == 3);  // both ends reached, and a cut inside
  // An input whose rows are not the sequence's (favor's projection W): its
  // gradient is the sum of the blocks'.
  constexpr auto F = dim<"F">;
  constexpr auto W = input<"W">(D, F);
  auto favor = check::recurrent(normalize(causal(phi<lina::favor>(Q, W) * transpose(phi<lina::favor>(K, W)))) * V);
  INFO(favor);
  CHECK(favor.ok());
  CHECK(has(favor, "∂W (two blocks)", "order::automatic"));
}

TEST_CASE("check: softmax has no linear order, static extents are kept, a sequence dimension is named where needed") {
  auto softmax = check::orderings(normalize(exp(Q * transpose(K) * 0.5)) * V);
  INFO(softmax);
  CHECK(softmax.ok());
  CHECK(softmax.findings.size() == 2);
  CHECK_FALSE(has(softmax, "out", "order::linear"));

  // Cross-attention without a mask, D static: N (the queries' rows) and S
  // (the keys') both sum over tokens; S is named, as compile(e, S) takes it.
  constexpr auto S = dim<"S">;
  constexpr auto D3 = dim<"D", 3>;
  constexpr auto Qc = input<"Q">(N, D3);
  constexpr auto Kc = input<"K">(S, D3);
  constexpr auto Vc = input<"V">(S, M);
  auto cross = check::orderings(phi<elu_plus_one>(Qc) * transpose(phi<elu_plus_one>(Kc)) * Vc, S, {.trials = 5, .seed = 7});
  INFO(cross);
  CHECK(cross.ok());
  CHECK(has(cross, "out", "order::linear"));
  for (auto const& f : cross.findings) CHECK(f.extents.find(" D=3") != std::string::npos);
}

TEST_CASE("check: each trial draws distinct extents, and inputs between low and high") {
  using E = std::remove_cvref_t<decltype(attention<elu_plus_one>)>;
  check::detail::rng r{11};
  for (int t = 0; t < 20; ++t) {
    check::detail::trial<E> x({.max_extent = 6, .low = 0.5, .high = 2}, r);
    std::set<std::size_t> extents(x.table.value.begin(), x.table.value.end());
    CHECK(extents.size() == 3);  // N, D, M
    for (std::size_t e : extents) CHECK((e >= 1 && e <= 6));
    CHECK(x.x[0].shape()[2] == x.table.get<std::remove_cvref_t<decltype(N)>>());
    CHECK(x.dout.shape()[3] == x.table.get<std::remove_cvref_t<decltype(M)>>());
    for (auto const* t4 : {&x.x[0], &x.x[1], &x.x[2], &x.dout})
      for (std::size_t i = 0; i < t4->size(); ++i) CHECK((t4->data()[i] >= 0.5 && t4->data()[i] < 2));
  }
}

TEST_CASE("check: options that would check nothing, or not what they say, throw naming the option") {
  // trials = 0 ran nothing and passed before this was an error.
  auto throws = [](check::options const& o, std::string const& option) {
    INFO(option);
    for (int which = 0; which < 3; ++which) {
      auto run = [&] {
        if (which == 0) return check::orderings(attention<square_plus_one>, o);
        if (which == 1) return check::gradients(attention<square_plus_one>, o);
        return check::recurrent(attention<square_plus_one>, o);
      };
      try {
        (void)run();
        FAIL("no exception");
      } catch (std::invalid_argument const& e) {
        CHECK(std::string(e.what()).find("options." + option + " = ") != std::string::npos);
      }
    }
  };
  double const nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  throws({.trials = 0}, "trials");
  throws({.trials = -1}, "trials");
  throws({.max_extent = 0}, "max_extent");
  throws({.max_batch = 0}, "max_batch");
  throws({.max_heads = 0}, "max_heads");
  throws({.low = nan}, "low");
  throws({.low = -inf}, "low");
  throws({.low = 1, .high = 1}, "high");
  throws({.high = nan}, "high");
  throws({.step = 0}, "step");
  throws({.step = -1e-6}, "step");
  throws({.step = inf}, "step");
  throws({.tolerance = -1}, "tolerance");
  throws({.tolerance = nan}, "tolerance");
  // The smallest valid options run and report.
  CHECK(check::orderings(attention<square_plus_one>, {.trials = 1, .max_extent = 1, .max_batch = 1, .max_heads = 1,
                                                      .tolerance = 0})
            .findings.size() == 3);
}
