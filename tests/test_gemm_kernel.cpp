// The CPU backend's product kernel (kernels::gemm: register tiles of the
// result, the columns left after whole vectors down the rows or through a
// padded copy, rows over idle threads) against a long-double product: random
// shapes from 0 to a few vectors and tiles, A in both layouts (the products
// of non-causal plans read φ(K)ᵀ, a transposed view), B not contiguous,
// accumulate or not; with known zeros (a triangle of A zero, only out's lower
// triangle wanted: the masked products of softmax; their diagonals on the
// first column or right of it) in half of the trials.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <lina/cpu/kernels.hpp>
#include <vector>

#include "support.hpp"

using namespace lina;
using idx = cpu::index;

namespace {

double uniform(test::rng& r) { return static_cast<double>(r.next() >> 11) * 0x1.0p-53 * 2.0 - 1.0; }

template <class T>
void check_random_products(std::uint64_t seed, int trials, idx largest) {
  test::rng r{seed};
  double worst = 0;
  for (int trial = 0; trial < trials; ++trial) {
    idx n = static_cast<idx>(r.in(0, static_cast<std::size_t>(largest)));
    idx k = static_cast<idx>(r.in(0, static_cast<std::size_t>(largest)));
    idx c = static_cast<idx>(r.in(1, 70));
    bool at = r.next() % 2, bt = r.next() % 2, accumulate = r.next() % 2;
    cpu::kernels::product_zeros zeros{};
    if (r.next() % 2) {
      zeros.a = static_cast<cpu::kernels::triangle>(r.next() % 3);
      zeros.lower_out = r.next() % 2;
      if (r.next() % 2) {  // diagonals right of the first column (a block of query rows' scores)
        zeros.a_diagonal = static_cast<idx>(r.in(0, 20));
        zeros.out_diagonal = static_cast<idx>(r.in(0, 20));
      }
    }
    CONTEXT(n, k, c, at, bt, accumulate);
    CONTEXT(static_cast<int>(zeros.a), zeros.lower_out, zeros.a_diagonal, zeros.out_diagonal);
    idx const oa = zeros.a_diagonal, oo = zeros.out_diagonal;
    std::vector<T> av(static_cast<std::size_t>(n * k) + 1), bv(static_cast<std::size_t>(k * c) + 1);
    for (auto& x : av) x = static_cast<T>(uniform(r));
    for (auto& x : bv) x = static_cast<T>(uniform(r));
    // A is n x k: row-major, or the transposed view of a k x n matrix; B likewise
    auto a = at ? cpu::view<T>(av.data(), n, k, 1, n) : cpu::view<T>(av.data(), n, k, k, 1);
    for (idx i = 0; i < n; ++i)  // the triangle gemm is told is zero
      for (idx p = 0; p < k; ++p)
        if ((zeros.a == cpu::kernels::triangle::lower && p > i + oa) ||
            (zeros.a == cpu::kernels::triangle::upper && p < i - oa))
          av[static_cast<std::size_t>(at ? p * n + i : i * k + p)] = 0;
    auto b = bt ? cpu::view<T>(bv.data(), k, c, 1, k) : cpu::view<T>(bv.data(), k, c, c, 1);
    idx ldo = c + 3;  // rows of out further apart than its columns
    std::vector<T> ov(static_cast<std::size_t>(n * ldo) + 1);
    for (auto& x : ov) x = static_cast<T>(uniform(r));
    std::vector<T> before = ov;
    cpu::matrix<T> out = cpu::view<T>(ov.data(), n, c, ldo, 1);
    cpu::kernels::gemm(a, cpu::view<T>(b.data, b.rows, b.cols, b.rs, b.cs), out, accumulate, zeros);
    bool ok = true;
    for (idx i = 0; i < n; ++i) {
      for (idx j = 0; j < c; ++j) {
        long double sum = accumulate ? before[static_cast<std::size_t>(i * ldo + j)] : 0, mag = std::abs(sum);
        for (idx p = 0; p < k; ++p) {
          sum += static_cast<long double>(a(i, p)) * b(p, j);
          mag += std::abs(static_cast<long double>(a(i, p)) * b(p, j));
        }
        double bound = double(k + 2) * std::numeric_limits<T>::epsilon() * double(mag) + std::numeric_limits<T>::min();
        if (zeros.lower_out && j > i + oo) {  // not wanted: written as zero
          ok = ok && ov[static_cast<std::size_t>(i * ldo + j)] == T(0);
          continue;
        }
        double err = double(std::abs(ov[static_cast<std::size_t>(i * ldo + j)] - sum));
        worst = std::max(worst, err / bound);
        ok = ok && err <= bound;
      }
      for (idx j = c; j < ldo; ++j)  // nothing written between rows
        ok = ok && ov[static_cast<std::size_t>(i * ldo + j)] == before[static_cast<std::size_t>(i * ldo + j)];
    }
    CHECK(ok);
  }
  MESSAGE("largest error / bound: " << worst);
}

}  // namespace

TEST_CASE_TEMPLATE("gemm matches a long-double product", T, float, double) {
  check_random_products<T>(sizeof(T) == 4 ? 51 : 52, 200, 40);
}

TEST_CASE_TEMPLATE("gemm over a long sum and over many rows (threads, blocks of the padded columns)", T, float, double) {
  check_random_products<T>(sizeof(T) == 4 ? 53 : 54, 6, 1500);
}

TEST_CASE_TEMPLATE("gemm gives the same bits whichever way A is laid out", T, float, double) {
  // A transposed view (φ(K)ᵀ) takes the columns left after whole vectors down
  // out's rows (gemm_columns), a row-major A through a padded strip: each
  // element is still the same chain of multiply-adds, term by term
  test::rng r{sizeof(T) == 4 ? 57 : 58};
  for (int trial = 0; trial < 40; ++trial) {
    idx n = static_cast<idx>(r.in(1, 150)), k = static_cast<idx>(r.in(1, trial < 4 ? 1200 : 90));
    idx c = static_cast<idx>(r.in(1, 70));
    bool accumulate = r.next() % 2;
    CONTEXT(n, k, c, accumulate);
    std::vector<T> rowmajor(static_cast<std::size_t>(n * k)), colmajor(rowmajor.size()), bv(static_cast<std::size_t>(k * c));
    for (idx i = 0; i < n; ++i)
      for (idx p = 0; p < k; ++p)
        rowmajor[static_cast<std::size_t>(i * k + p)] = colmajor[static_cast<std::size_t>(p * n + i)] =
            static_cast<T>(uniform(r));
    for (auto& x : bv) x = static_cast<T>(uniform(r));
    std::vector<T> o1(static_cast<std::size_t>(n * c));
    for (auto& x : o1) x = static_cast<T>(uniform(r));
    std::vector<T> o2 = o1;
    cpu::matrix<T> out1 = cpu::view<T>(o1.data(), n, c, c, 1), out2 = cpu::view<T>(o2.data(), n, c, c, 1);
    cpu::kernels::gemm(cpu::view<T>(rowmajor.data(), n, k, k, 1), cpu::view<T>(bv.data(), k, c, c, 1), out1, accumulate);
    cpu::kernels::gemm(cpu::view<T>(colmajor.data(), n, k, 1, n), cpu::view<T>(bv.data(), k, c, c, 1), out2, accumulate);
    CHECK(o1 == o2);
  }
}

TEST_CASE_TEMPLATE("favor through one product of all rows gives the bits of its row-by-row apply", T, float, double) {
  // kernels::feature_map projects every row at once when the map has finish();
  // the sums are the same, in the same order, as favor::apply's
  test::rng r{55};
  for (idx n : {1, 7, 300}) {
    idx d = static_cast<idx>(r.in(1, 70)), m = static_cast<idx>(r.in(1, 300));
    CONTEXT(n, d, m);
    std::vector<T> xv(static_cast<std::size_t>(n * d)), wv(static_cast<std::size_t>(d * m));
    for (auto& x : xv) x = static_cast<T>(uniform(r));
    for (auto& x : wv) x = static_cast<T>(uniform(r));
    auto x = cpu::view<T>(xv.data(), n, d, d, 1), w = cpu::view<T>(wv.data(), d, m, m, 1);
    cpu::matrix<T> out = cpu::allocate<T>(n, m);
    cpu::kernels::feature_map<favor>(x, w, out);
    std::vector<T> row(static_cast<std::size_t>(m));
    bool same = true;
    for (idx i = 0; i < n; ++i) {
      favor::apply(xv.data() + i * d, static_cast<std::size_t>(d), static_cast<T const*>(wv.data()),
                   static_cast<std::size_t>(m), row.data());
      for (idx j = 0; j < m; ++j) same = same && out(i, j) == row[static_cast<std::size_t>(j)];
    }
    CHECK(same);
  }
}
