// The CPU backend's scan kernel (kernels::scan_contract) against a plain
// double-precision loop: random shapes, both directions, strided and
// transposed views, chained calls from a non-zero state; split calls agree
// bit for bit with one call; the scratch is one small allocation.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <lina/cpu/kernels.hpp>
#include <vector>

#include "support.hpp"

using namespace lina;
using idx = cpu::index;
using cpu::matrix;

namespace {

double uniform(test::rng& r) { return static_cast<double>(r.next() >> 11) * 0x1.0p-53 * 2.0 - 1.0; }

// The state's rows (A's and B's width): one draw in four a whole number of
// 16-column blocks, where the kernel reads contiguous rows of A and B where
// they are instead of packing them; else any width from 1 to 70.
idx state_rows(test::rng& r) {
  return r.next() % 4 == 0 ? 16 * static_cast<idx>(r.in(1, 4)) : static_cast<idx>(r.in(1, 70));
}

// An n x d matrix of random values in [-1, 1), stored row-major, column-major
// (a transposed view: cs != 1) or with padded rows, as the kernel sees it.
template <class T>
struct operand {
  std::vector<T> store;
  matrix<T> m;
  operand(test::rng& r, idx n, idx d, int layout) {
    idx pad = layout == 2 ? 3 : 0;
    store.resize(static_cast<std::size_t>(std::max<idx>(1, layout == 1 ? n * d : n * (d + pad))));
    for (auto& x : store) x = static_cast<T>(uniform(r));
    if (layout == 1)
      m = cpu::view<T>(store.data(), n, d, 1, n);  // column-major
    else
      m = cpu::view<T>(store.data(), n, d, d + pad, 1);
  }
};

struct reference {
  std::vector<double> out, bound;  // N x db, and a bound on each element's rounding
};

// The scan in double, with each element's sum of |terms| for the error bound.
template <class T>
reference reference_scan(matrix<T> const& a, matrix<T> const& b, matrix<T> const& c, std::vector<double> const& s0,
                         bool reverse, idx extra_roundings = 0) {
  using wide = long double;  // wider than double where the platform has it
  idx n = b.rows, da = b.cols, db = c.cols;
  std::vector<wide> s(s0.begin(), s0.end()), mag(s.size());
  for (std::size_t k = 0; k < s.size(); ++k) mag[k] = std::abs(s[k]);
  reference r{std::vector<double>(static_cast<std::size_t>(n * db)), std::vector<double>(static_cast<std::size_t>(n * db))};
  double eps = std::numeric_limits<T>::epsilon();
  for (idx t = 0; t < n; ++t) {
    idx i = reverse ? n - 1 - t : t;
    for (idx p = 0; p < da; ++p)
      for (idx q = 0; q < db; ++q) {
        s[static_cast<std::size_t>(p * db + q)] += wide(b(i, p)) * wide(c(i, q));
        mag[static_cast<std::size_t>(p * db + q)] += std::abs(wide(b(i, p)) * wide(c(i, q)));
      }
    for (idx q = 0; q < db; ++q) {
      wide o = 0, m = 0;
      for (idx p = 0; p < da; ++p) {
        o += wide(a(i, p)) * s[static_cast<std::size_t>(p * db + q)];
        m += std::abs(wide(a(i, p))) * mag[static_cast<std::size_t>(p * db + q)];
      }
      // a sum of (t + 1) state terms, then of da products: each term carries at
      // most (t + da + 2) roundings, so this bounds the worst case (plus what
      // another association of the same sums adds: extra_roundings).
      r.out[static_cast<std::size_t>(i * db + q)] = double(o);
      r.bound[static_cast<std::size_t>(i * db + q)] =
          double(t + da + 2 + extra_roundings) * eps * double(m) + 4 * std::numeric_limits<T>::min();
    }
  }
  return r;
}

// parts = 0: scan_contract; parts >= 2: scan_contract_split over that many
// threads, whose parts start from the sums of the parts before them (summed
// in pieces: up to parts more additions in the state, da more roundings
// allowed in the outputs).
// shortest > 0: every scan has between shortest and 2 x shortest rows.
template <class T>
void check_random_scans(std::uint64_t seed, int trials, int parts = 0, idx shortest = 0) {
  test::rng r{seed};
  double worst = 0;  // largest error / bound
  for (int trial = 0; trial < trials; ++trial) {
    idx n = static_cast<idx>(shortest ? r.in(static_cast<std::uint64_t>(shortest), static_cast<std::uint64_t>(2 * shortest))
                             : trial % 5 == 0 ? r.in(0, 3)
                                              : r.in(0, parts ? 1500 : 300));
    idx da = state_rows(r), db = static_cast<idx>(r.in(1, 70));
    bool reverse = r.next() % 2;
    int la = static_cast<int>(r.in(0, 2)), lb = static_cast<int>(r.in(0, 2)), lc = static_cast<int>(r.in(0, 2));
    CONTEXT(n, da, db, reverse, la, lb, lc);
    operand<T> a(r, n, da, la), b(r, n, da, lb), c(r, n, db, lc);
    std::vector<T> state(static_cast<std::size_t>(da * db));
    bool chained = r.next() % 2;  // start from a non-zero state, as a later block of a chained scan
    for (auto& x : state) x = chained ? static_cast<T>(uniform(r) * 4) : T(0);
    std::vector<double> s0(state.begin(), state.end());
    idx extra = parts ? da + parts + 1 : 0;
    reference ref = reference_scan(a.m, b.m, c.m, s0, reverse, extra);

    matrix<T> out = cpu::allocate<T>(n, db);
    matrix<T> cv = cpu::view(c.m.data, c.m.rows, c.m.cols, c.m.rs, c.m.cs);
    if (parts)
      cpu::kernels::scan_contract_split(a.m, b.m, cv, out, state.data(), reverse, parts);
    else
      cpu::kernels::scan_contract(a.m, b.m, std::move(cv), out, state.data(), reverse);
    bool ok = true;
    for (idx i = 0; i < n; ++i)
      for (idx q = 0; q < db; ++q) {
        auto k = static_cast<std::size_t>(i * db + q);
        double err = std::abs(double(out(i, q)) - ref.out[k]);
        worst = std::max(worst, err / ref.bound[k]);
        ok = ok && err <= ref.bound[k];
      }
    CHECK(ok);

    // the final state is the whole sum
    bool state_ok = true;
    for (idx p = 0; p < da; ++p)
      for (idx q = 0; q < db; ++q) {
        long double sum = s0[static_cast<std::size_t>(p * db + q)], mag = std::abs(sum);
        for (idx i = 0; i < n; ++i) {
          sum += static_cast<long double>(b.m(i, p)) * c.m(i, q);
          mag += std::abs(static_cast<long double>(b.m(i, p)) * c.m(i, q));
        }
        double err = double(std::abs(state[static_cast<std::size_t>(p * db + q)] - sum));
        state_ok = state_ok && err <= double(n + 1 + extra) * std::numeric_limits<T>::epsilon() * double(mag) +
                                          std::numeric_limits<T>::min();
      }
    CHECK(state_ok);
  }
  MESSAGE("largest error / bound: " << worst);
}

// One call over all rows against the same rows in calls of random lengths
// (down to one row, as recurrent steps), the state carried between them.
template <class T>
void check_split_calls(std::uint64_t seed, int trials) {
  test::rng r{seed};
  for (int trial = 0; trial < trials; ++trial) {
    idx n = static_cast<idx>(r.in(1, 300)), da = state_rows(r), db = static_cast<idx>(r.in(1, 70));
    bool reverse = r.next() % 2;
    int la = static_cast<int>(r.in(0, 2)), lb = static_cast<int>(r.in(0, 2));
    CONTEXT(n, da, db, reverse);
    operand<T> a(r, n, da, la), b(r, n, da, lb), c(r, n, db, 0);
    std::vector<T> init(static_cast<std::size_t>(da * db));
    for (auto& x : init) x = static_cast<T>(uniform(r));

    std::vector<T> whole_state = init;
    matrix<T> whole = cpu::allocate<T>(n, db);
    cpu::kernels::scan_contract(a.m, b.m, cpu::view(c.m.data, n, db, c.m.rs, c.m.cs), whole, whole_state.data(), reverse);

    std::vector<T> state = init;
    bool same = true;
    idx done = 0;  // rows scanned, in scan order
    while (done < n) {
      idx len = std::min<idx>(n - done, trial % 3 == 0 ? 1 : static_cast<idx>(r.in(1, 100)));
      idx first = reverse ? n - done - len : done;  // the rows [first, first + len)
      auto rows = [&](matrix<T> const& x) { return cpu::view(x.data + first * x.rs, len, x.cols, x.rs, x.cs); };
      matrix<T> part = cpu::allocate<T>(len, db);
      cpu::kernels::scan_contract(rows(a.m), rows(b.m), rows(c.m), part, state.data(), reverse);
      for (idx i = 0; i < len; ++i)
        for (idx q = 0; q < db; ++q) same = same && part(i, q) == whole(first + i, q);
      done += len;
    }
    CHECK(same);
    CHECK(state == whole_state);
  }
}

}  // namespace

// A dual scan (kernels::scan_rows with a second output) against the two
// scans it replaces: its first output and final state are those of the
// single scan, bit for bit; its second, S_i x_i, matches the transposed scan
// (x as A, c and b swapped, from the transposed state) in double precision.
template <class T>
void check_dual_scans(std::uint64_t seed, int trials, idx shortest = 0) {
  test::rng r{seed};
  double worst = 0;
  for (int trial = 0; trial < trials; ++trial) {
    idx n = static_cast<idx>(shortest ? r.in(static_cast<std::uint64_t>(shortest), static_cast<std::uint64_t>(2 * shortest))
                             : trial % 5 == 0 ? r.in(0, 3)
                                              : r.in(0, 300));
    idx da = state_rows(r), db = static_cast<idx>(r.in(1, 70));
    bool reverse = r.next() % 2;
    int la = static_cast<int>(r.in(0, 2)), lb = static_cast<int>(r.in(0, 2)), lc = static_cast<int>(r.in(0, 2));
    int lx = static_cast<int>(r.in(0, 2));
    CONTEXT(n, da, db, reverse, la, lb, lc, lx);
    operand<T> a(r, n, da, la), b(r, n, da, lb), c(r, n, db, lc), x(r, n, db, lx);
    std::vector<T> init(static_cast<std::size_t>(da * db));
    for (auto& v : init) v = static_cast<T>(uniform(r) * 2);
    std::vector<double> s0t(init.size());  // the transposed state, for the reference of the second output
    for (idx p = 0; p < da; ++p)
      for (idx q = 0; q < db; ++q) s0t[static_cast<std::size_t>(q * da + p)] = init[static_cast<std::size_t>(p * db + q)];
    reference ref2 = reference_scan(x.m, c.m, b.m, s0t, reverse);

    std::vector<T> single_state = init, dual_state = init;
    matrix<T> single = cpu::allocate<T>(n, db), out = cpu::allocate<T>(n, db), out2 = cpu::allocate<T>(n, da);
    cpu::kernels::scan_contract(a.m, b.m, cpu::view(c.m.data, n, db, c.m.rs, c.m.cs), single, single_state.data(),
                                reverse);
    using rows = cpu::kernels::matrix_rows<T>;
    using sink = cpu::kernels::matrix_sink<T>;
    rows ar{a.m}, br{b.m}, cr{c.m}, xr{x.m};
    sink os{out}, o2s{out2};
    cpu::kernels::second<rows, sink> sec{xr, o2s};
    std::vector<T> scratch(cpu::kernels::scan_scratch_size<T>(n, ar, br, cr, os, sec));
    cpu::kernels::scan_rows(ar, br, cr, os, 0, n, dual_state.data(), reverse, scratch.data(), sec);

    bool same = dual_state == single_state;
    for (idx i = 0; i < n; ++i)
      for (idx q = 0; q < db; ++q) same = same && out(i, q) == single(i, q);
    CHECK(same);
    bool ok = true;
    for (idx i = 0; i < n; ++i)
      for (idx p = 0; p < da; ++p) {
        auto k = static_cast<std::size_t>(i * da + p);
        double err = std::abs(double(out2(i, p)) - ref2.out[k]);
        worst = std::max(worst, err / ref2.bound[k]);
        ok = ok && err <= ref2.bound[k];
      }
    CHECK(ok);
  }
  MESSAGE("second output: largest error / bound " << worst);
}

TEST_CASE_TEMPLATE("a dual scan gives the single scan's bits and the transposed scan's rows", T, float, double) {
  check_dual_scans<T>(sizeof(T) == 4 ? 41 : 42, 120);
}

TEST_CASE("a long dual scan (two levels of sums) gives the single scan's bits and the transposed scan's rows") {
  check_dual_scans<float>(43, 4, cpu::kernels::two_level_rows<float> + 1);
}

TEST_CASE_TEMPLATE("scan_contract matches a double-precision scan", T, float, double) {
  check_random_scans<T>(sizeof(T) == 4 ? 11 : 12, 300);
}

TEST_CASE("long float scans (two levels of sums) match a double-precision scan") {
  check_random_scans<float>(13, 6, 0, cpu::kernels::two_level_rows<float> + 1);
  check_random_scans<float>(14, 3, 2, 2 * (cpu::kernels::two_level_rows<float> + 1));  // split: each part too
}

TEST_CASE_TEMPLATE("a scan split across threads matches a double-precision scan", T, float, double) {
  check_random_scans<T>(11, 25, 2);
  check_random_scans<T>(12, 15, 3);
}

TEST_CASE_TEMPLATE("scan_contract split into calls gives the bits of one call", T, float, double) {
  check_split_calls<T>(sizeof(T) == 4 ? 21 : 22, 60);
}

// Relative errors (largest, mean) of the row-by-row float scan and of
// scan_contract over n rows of positive terms (the normaliser's column:
// errors accumulate instead of cancelling), against the double reference.
struct long_sum_errors {
  double old_max = 0, old_mean = 0, new_max = 0, new_mean = 0;
};
long_sum_errors long_sum(idx n) {
  test::rng r{31};
  idx da = 8, db = 9;
  std::vector<float> av(static_cast<std::size_t>(n * da)), bv(av.size()), cv(static_cast<std::size_t>(n * db));
  for (auto& x : av) x = static_cast<float>(uniform(r) * 0.5 + 0.5);
  for (auto& x : bv) x = static_cast<float>(uniform(r) * 0.5 + 0.5);
  for (auto& x : cv) x = static_cast<float>(uniform(r) * 0.5 + 0.5);
  auto a = cpu::view<float>(av.data(), n, da, da, 1), b = cpu::view<float>(bv.data(), n, da, da, 1);
  auto c = cpu::view<float>(cv.data(), n, db, db, 1);
  reference ref = reference_scan(a, b, c, std::vector<double>(static_cast<std::size_t>(da * db)), false);

  long_sum_errors e;
  std::vector<float> s(static_cast<std::size_t>(da * db));
  for (idx i = 0; i < n; ++i) {  // the row-by-row scan in float
    for (idx p = 0; p < da; ++p)
      for (idx q = 0; q < db; ++q) s[static_cast<std::size_t>(p * db + q)] += b(i, p) * c(i, q);
    for (idx q = 0; q < db; ++q) {
      float acc = 0;
      for (idx p = 0; p < da; ++p) acc += a(i, p) * s[static_cast<std::size_t>(p * db + q)];
      double want = ref.out[static_cast<std::size_t>(i * db + q)], err = std::abs(double(acc) - want) / want;
      e.old_max = std::max(e.old_max, err);
      e.old_mean += err;
    }
  }
  std::vector<float> state(static_cast<std::size_t>(da * db));
  matrix<float> out = cpu::allocate<float>(n, db);
  cpu::kernels::scan_contract(a, b, cpu::view<float>(cv.data(), n, db, db, 1), out, state.data(), false);
  for (idx i = 0; i < n; ++i)
    for (idx q = 0; q < db; ++q) {
      double want = ref.out[static_cast<std::size_t>(i * db + q)], err = std::abs(double(out(i, q)) - want) / want;
      e.new_max = std::max(e.new_max, err);
      e.new_mean += err;
    }
  e.old_mean /= double(n * db);
  e.new_mean /= double(n * db);
  MESSAGE("n = " << n << ": relative error, largest and mean: row by row " << e.old_max << ", " << e.old_mean
                 << "; scan_contract " << e.new_max << ", " << e.new_mean);
  return e;
}

TEST_CASE("scan_contract: float sums up to two_level_rows are as accurate as the row-by-row scan") {
  // The same sums in the same order; only where a compiler fuses a multiply
  // and an add may differ, so the errors agree within a few percent.
  long_sum_errors e = long_sum(cpu::kernels::two_level_rows<float>);
  CHECK(e.new_mean <= e.old_mean * 1.05);
  CHECK(e.new_max <= e.old_max * 1.05);
}

TEST_CASE("scan_contract: longer float sums in two levels are more accurate than row by row") {
  // Each 64-row chunk summed from zero, then added to the state: the error
  // grows like sqrt(64 + n / 64) eps instead of sqrt(n) eps, 7x less at
  // n = 20000 (measured: 7x for the mean, 8x for the largest); 3x is asserted.
  static_assert(cpu::kernels::two_level_rows<float> < 20000 && cpu::kernels::two_level_rows<double> > (1LL << 40));
  long_sum_errors e = long_sum(20000);
  CHECK(e.new_mean * 3 <= e.old_mean);
  CHECK(e.new_max * 3 <= e.old_max);
}

TEST_CASE("scan_contract allocates its scratch once, independent of N") {
  for (idx n : {1, 1000, 100000}) {
    idx da = 16, db = 9;
    std::vector<float> av(static_cast<std::size_t>(n * da), 0.5f), cv(static_cast<std::size_t>(n * db), 0.25f);
    auto a = cpu::view<float>(av.data(), n, da, da, 1);
    auto at = cpu::view<float>(av.data(), n, da, 1, n);  // transposed: packed without a copy
    std::vector<float> state(static_cast<std::size_t>(da * db));
    matrix<float> out = cpu::allocate<float>(n, db);
    cpu::memory().reset();
    cpu::kernels::scan_contract(at, a, cpu::view<float>(cv.data(), n, db, 1, n), out, state.data(), n % 2 == 0);
    CAPTURE(n);
    CHECK(cpu::memory().allocations == 1);
    CHECK(cpu::memory().largest <= 4 * (64 * 16 + 64 * 16) * sizeof(float));
  }
}
