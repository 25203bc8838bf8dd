// What the CPU backend allocates: a linear plan never allocates anything
// N x N, and its temporaries grow linearly in N (Eigen-style no-temporary
// tests, counting the backend's buffers).
#include <doctest/doctest.h>

#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <lina/cpu.hpp>
#include <lina/lina.hpp>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace lina;

namespace {
constexpr auto N = dim<"N">;
constexpr auto D = dim<"D", 16>;
constexpr auto M = dim<"M", 8>;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
constexpr auto attn = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;

template <class Plan>
std::size_t largest_allocation(Plan const& plan, std::size_t n) {
  auto q = tensor<float>::random({1, 2, n, 16}, 1), k = tensor<float>::random({1, 2, n, 16}, 2);
  auto v = tensor<float>::random({1, 2, n, 8}, 3);
  cpu::release_cached_memory();  // count this call's memory, not what earlier calls keep
  cpu::memory().reset();
  auto out = cpu::evaluate(plan, Q = q, K = k, V = v);
  return cpu::memory().largest;
}
}  // namespace

TEST_CASE("a linear forward allocates no N-row temporary: φ(Q), φ(K), [V|1] and rowdiv run inside the scan") {
  if (cpu::current_path() == cpu::path::simple) {
    MESSAGE("the simple path materialises every operand: checked on the fast path");
    return;
  }
  std::size_t first = 0;
  for (std::size_t n : {1000u, 4000u, 16000u}) {
    std::size_t lin = largest_allocation(compile<order::linear>(attn), n);
    std::size_t automatic = largest_allocation(compile(attn), n);
    if (!first) first = lin;
    CHECK(lin == first);                    // chunk buffers only: the same for every N
    CHECK(lin < 1000 * 8 * sizeof(float));  // below one N x M matrix at the shortest N
    CHECK(automatic == lin);  // past the threshold the automatic plan is the linear one
    cpu::release_cached_memory();
    CHECK(cpu::memory().live == 0);  // every temporary was released or is in the cache
  }
}

TEST_CASE("the slices of one call reuse their thread's memory") {
  auto plan = compile<order::linear>(attn);
  auto allocations = [&](std::size_t heads) {
    std::size_t n = 3000;
    auto q = tensor<float>::random({1, heads, n, 16}, 1), k = tensor<float>::random({1, heads, n, 16}, 2);
    auto v = tensor<float>::random({1, heads, n, 8}, 3), dout = tensor<float>::random({1, heads, n, 8}, 4);
    cpu::release_cached_memory();  // count this call's memory, not what earlier calls keep
    cpu::memory().reset();
    auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
    return cpu::memory().allocations.load();
  };
  std::size_t threads = 1;
#ifdef _OPENMP
  threads = static_cast<std::size_t>(omp_get_max_threads());
#endif
  std::size_t one = allocations(1);
  CHECK(one > 0);
  CHECK(allocations(16) <= threads * one);  // not 16x: each thread's later slices take the first's buffers
}

TEST_CASE("the quadratic forward makes its scores a block of query rows at a time (N x N on the simple path)") {
  if (cpu::current_path() == cpu::path::simple) {  // the oracle runs plans whole: the counters see N x N
    std::size_t n = 1000;
    CHECK(largest_allocation(compile<order::quadratic>(attn), n) == n * n * sizeof(float));
    return;
  }
  for (std::size_t n : {1000u, 4000u}) {
    CAPTURE(n);
    std::size_t const rows = cpu::row_blocks::rows_per_block(n);
    CHECK(rows < n);
    std::size_t const largest = largest_allocation(compile<order::quadratic>(attn), n);
    CHECK(largest <= rows * n * sizeof(float));  // a block's scores: its rows x the keys it reads
    CHECK(4 * largest >= rows * n * sizeof(float));  // (and they are counted)
  }
}

namespace {
struct backward_memory {
  std::size_t largest, peak;
};
template <class Plan>
backward_memory backward_allocations(Plan const& plan, std::size_t n) {
  auto q = tensor<float>::random({1, 2, n, 16}, 1), k = tensor<float>::random({1, 2, n, 16}, 2);
  auto v = tensor<float>::random({1, 2, n, 8}, 3), dout = tensor<float>::random({1, 2, n, 8}, 4);
  cpu::release_cached_memory();  // count this call's memory, not what earlier calls keep
  cpu::memory().reset();
  auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  return {cpu::memory().largest, cpu::memory().peak};
}
}  // namespace

TEST_CASE("the linear backward needs O(N (C + M)) extra memory, no N x N, no per-step state") {
  auto plan = compile<order::linear>(attn);
  std::size_t threads = 2;  // at most two slices are in flight on this machine; more only raises the bound
#ifdef _OPENMP
  threads = static_cast<std::size_t>(omp_get_max_threads());
#endif
  for (std::size_t n : {2000u, 8000u}) {
    auto mem = backward_allocations(plan, n);
    // The largest temporary is one N x max(C, M+1) matrix (φ(Q), [V|1], ...);
    // a per-step state cache would be N x C x (M+1), 9x larger, and N x N, 125x.
    CHECK(mem.largest <= n * 16 * sizeof(float));
    // At most 8 such matrices are alive at once in a slice (the deepest
    // gradient, ∂K, holds [V|1], φ(Q), φ(K), the recomputed forward, rowdiv′,
    // its own result and φ′'s input), plus the scan state.
    CHECK(mem.peak <= threads * (8 * n * 17 * sizeof(float) + 16 * 17 * sizeof(float)));
    cpu::release_cached_memory();
    CHECK(cpu::memory().live == 0);
  }
}

TEST_CASE("the softmax backward runs a block of query rows at a time (N x N on the simple path)") {
  constexpr auto softmax = normalize(causal(exp(Q * transpose(K)))) * V;
  std::size_t const n = 1000;
  // a quadratic order of linear attention differentiates whole (its linear order is the O(N) one)
  CHECK(backward_allocations(compile<order::quadratic>(attn), n).largest == n * n * sizeof(float));
  if (cpu::current_path() == cpu::path::simple) {  // the oracle runs plans whole
    CHECK(backward_allocations(compile(softmax), n).largest == n * n * sizeof(float));
    return;
  }
  std::size_t const rows = cpu::row_blocks::rows_per_block(n);
  auto const mem = backward_allocations(compile(softmax), n);
  CHECK(mem.largest <= rows * n * sizeof(float));      // a block's scores and their adjoints
  CHECK(4 * mem.largest >= rows * n * sizeof(float));  // (and they are counted)
}

TEST_CASE("softmax through a tape keeps nothing and runs forward and backward a block of query rows at a time") {
  constexpr auto softmax = normalize(causal(exp(Q * transpose(K)))) * V;
  auto const plan = compile(softmax);
  std::size_t const n = 1000, rows = cpu::row_blocks::rows_per_block(n);
  auto q = tensor<float>::random({1, 2, n, 16}, 1), k = tensor<float>::random({1, 2, n, 16}, 2);
  auto v = tensor<float>::random({1, 2, n, 8}, 3), dout = tensor<float>::random({1, 2, n, 8}, 4);
  std::size_t const whole = n * n * sizeof(float), block = rows * n * sizeof(float);
  bool const simple = cpu::current_path() == cpu::path::simple;  // (the oracle runs plans whole)
  cpu::tape<float> tp;
  cpu::release_cached_memory();
  cpu::memory().reset();
  auto out = cpu::evaluate(plan, tp, Q = q, K = k, V = v);
  CHECK(tp.size() == 0);
  CHECK(cpu::memory().largest <= (simple ? whole : block));
  cpu::release_cached_memory();
  cpu::memory().reset();
  auto g = cpu::gradient(plan, tp, dout, Q = q, K = k, V = v);
  CHECK(cpu::memory().largest <= (simple ? whole : block));
  CHECK(4 * cpu::memory().largest >= (simple ? whole : block));  // (and they are counted)
  // the same calls as without a tape: the same bits
  CHECK(max_abs_diff(out, cpu::evaluate(plan, Q = q, K = k, V = v)) == 0);
  auto want = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  for (std::size_t i = 0; i < g.all().size(); ++i) CHECK(max_abs_diff(g.all()[i], want.all()[i]) == 0);
}

TEST_CASE("packed softmax sequences run a block of query rows at a time, each sequence its own blocks") {
  if (cpu::current_path() == cpu::path::simple) {
    MESSAGE("the simple path runs plans whole: checked on the fast path");
    return;
  }
  auto const plan = compile(normalize(causal(exp(Q * transpose(K)))) * V);
  auto const seqs = sequences::from_lengths({1000, 300, 1200});
  std::size_t const n = seqs.total(), longest = 1200, rows = cpu::row_blocks::rows_per_block(longest);
  REQUIRE(rows < longest);
  auto q = tensor<float>::random({1, 2, n, 16}, 1), k = tensor<float>::random({1, 2, n, 16}, 2);
  auto v = tensor<float>::random({1, 2, n, 8}, 3), dout = tensor<float>::random({1, 2, n, 8}, 4);
  cpu::release_cached_memory();
  cpu::memory().reset();
  auto out = cpu::evaluate(plan, seqs, Q = q, K = k, V = v);
  CHECK(cpu::memory().largest <= rows * longest * sizeof(float));
  cpu::release_cached_memory();
  cpu::memory().reset();
  auto g = cpu::gradient(plan, dout, seqs, Q = q, K = k, V = v);
  CHECK(cpu::memory().largest <= rows * longest * sizeof(float));  // (whole: 1200 x 1200)
}

TEST_CASE("calls from several threads at once each give the bits of the same call made alone") {
  // A server may run requests on threads of its own. Each call takes a
  // workspace of its own from the pool (and starts its own OpenMP team), so
  // calls at once share nothing they write: linear and softmax plans (the
  // latter in blocks of rows), forward, backward and a tape, four callers at
  // once, three rounds each, against the same calls made one at a time.
  auto const linear = compile<order::linear>(attn);
  auto const softmax = compile(normalize(causal(exp(Q * transpose(K)))) * V);
  auto calls = [&](std::size_t n, std::uint64_t seed) {
    auto q = tensor<float>::random({1, 2, n, 16}, seed), k = tensor<float>::random({1, 2, n, 16}, seed + 1);
    auto v = tensor<float>::random({1, 2, n, 8}, seed + 2), dout = tensor<float>::random({1, 2, n, 8}, seed + 3);
    std::vector<tensor<float>> got;
    got.push_back(cpu::evaluate(linear, Q = q, K = k, V = v));
    auto g1 = cpu::gradient(linear, dout, Q = q, K = k, V = v);
    for (auto& g : g1.all()) got.push_back(std::move(g));
    cpu::tape<float> tp;
    got.push_back(cpu::evaluate(softmax, tp, Q = q, K = k, V = v));
    auto g2 = cpu::gradient(softmax, tp, dout, Q = q, K = k, V = v);
    for (auto& g : g2.all()) got.push_back(std::move(g));
    return got;
  };
  constexpr int callers = 4, rounds = 3;
  auto length = [](int c) { return std::size_t(300 + 250 * c); };  // the last past a block of rows (512)
  std::vector<std::vector<tensor<float>>> alone;
  for (int c = 0; c < callers; ++c) alone.push_back(calls(length(c), 10 * std::uint64_t(c) + 1));
  std::vector<std::vector<double>> diffs(callers);  // (doctest's checks stay on this thread)
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c)
    threads.emplace_back([&, c] {
      for (int r = 0; r < rounds; ++r) {
        auto got = calls(length(c), 10 * std::uint64_t(c) + 1);
        for (std::size_t i = 0; i < got.size(); ++i) diffs[c].push_back(max_abs_diff(got[i], alone[c][i]));
      }
    });
  for (auto& t : threads) t.join();
  for (int c = 0; c < callers; ++c) {
    CAPTURE(c);
    REQUIRE(diffs[c].size() == rounds * alone[c].size());
    for (double d : diffs[c]) CHECK(d == 0);
  }
}

// A result evaluate or gradient returns is a tensor made lina::uninitialized
// (not zero-filled first: the call writes every element). The tests build
// with LINA_POISON_UNINITIALIZED, so such a tensor starts as NaN and an
// element a backend left unwritten shows as a NaN in whatever test reads it.
TEST_CASE("new results are not zero-filled first, and every element is written: in the tests they start as NaN") {
  auto all_finite = [](auto const& t) {
    bool ok = t.size() > 0;
    for (std::size_t i = 0; i < t.size(); ++i) ok = ok && std::isfinite(t.data()[i]);
    return ok;
  };
  tensor<float> fresh({1, 2, 3, 4}, uninitialized), zeros({1, 2, 3, 4});
  auto like = tensor<double>::like(tensor_view<double const>(nullptr, {1, 2, 3, 4}, {24, 1, 8, 2}), uninitialized);
  CHECK(std::isnan(fresh(0, 1, 2, 3)));
  CHECK(std::isnan(like(0, 1, 2, 3)));
  CHECK(like.strides() == strides4{24, 1, 8, 2});
  CHECK(zeros(0, 1, 2, 3) == 0.0f);
  auto q = tensor<float>::random({2, 2, 37, 16}, 1), k = tensor<float>::random({2, 2, 37, 16}, 2);
  auto v = tensor<float>::random({2, 2, 37, 8}, 3), dout = tensor<float>::random({2, 2, 37, 8}, 4);
  auto plan = compile<order::linear>(attn);
  CHECK(all_finite(cpu::evaluate(plan, Q = q, K = k, V = v)));
  auto g = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  CHECK(all_finite(g[Q]));
  CHECK(all_finite(g[K]));
  CHECK(all_finite(g[V]));
}

TEST_CASE("repeated calls reuse the memory of earlier ones until it is released") {
  // One slice, shorter than a split sequence: the calls run on this thread
  // alone, so the second asks its arena for exactly what the first left there.
  auto plan = compile<order::linear>(attn);
  std::size_t n = 1500;
  auto q = tensor<float>::random({1, 1, n, 16}, 1), k = tensor<float>::random({1, 1, n, 16}, 2);
  auto v = tensor<float>::random({1, 1, n, 8}, 3), dout = tensor<float>::random({1, 1, n, 8}, 4);
  cpu::release_cached_memory();
  cpu::memory().reset();
  auto g1 = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  std::size_t first = cpu::memory().allocations;
  CHECK(first > 0);
  CHECK(cpu::memory().live > 0);  // kept for the next call
  cpu::memory().reset();
  auto g2 = cpu::gradient(plan, dout, Q = q, K = k, V = v);
  CHECK(cpu::memory().allocations == 0);  // the second call takes the first one's buffers
  CHECK(max_abs_diff(g1[Q], g2[Q]) == 0);
  cpu::release_cached_memory();
  CHECK(cpu::memory().live == 0);
}

#ifdef LINA_ASAN  // (lina/cpu/matrix.hpp: ASan and LINA_ASAN_WORKSPACES, as the test command builds this binary)
// A step's buffer comes from its thread's workspace, often one an earlier
// step gave back and larger than asked for: under AddressSanitizer its
// elements past the request, and all of it once given back, are
// unaddressable, so that an overrun or a view read after its step's release
// is reported as on a fresh allocation.
TEST_CASE("under AddressSanitizer a workspace buffer is addressable only while taken and as far as asked") {
  cpu::workspace<float> ws;
  ws.begin(1);
  float* p = ws.take(0, 32);
  CHECK_FALSE(__asan_address_is_poisoned(p + 31));
  ws.give(0, p);
  CHECK(__asan_address_is_poisoned(p));
  float* q = ws.take(0, 3);  // the same buffer again
  REQUIRE(q == p);
  CHECK_FALSE(__asan_address_is_poisoned(q + 2));
  CHECK(__asan_address_is_poisoned(q + 3));
  CHECK(__asan_address_is_poisoned(q + 31));
  ws.begin(1);  // the next call: every buffer free
  CHECK(__asan_address_is_poisoned(q));
}
#endif

#if defined(__linux__) && defined(MADV_HUGEPAGE)
namespace {
// The word in brackets of /sys/kernel/mm/transparent_hugepage/enabled
// ("always", "madvise", "never"), empty where the kernel has no such file.
std::string huge_page_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  auto open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos ? "" : line.substr(open + 1, close - open - 1);
}
// THPeligible of the mapping that holds p (/proc/self/smaps): 1 where the
// kernel may back it with huge pages; -1 where it does not say.
int huge_page_eligible(void const* p) {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  std::ifstream f("/proc/self/smaps");
  bool inside = false;
  for (std::string line; std::getline(f, line);) {
    std::uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2) {  // a mapping's first line
      inside = lo <= a && a < hi;
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      return std::atoi(line.c_str() + 12);
    }
  }
  return -1;
}
bool on_huge_page_boundary(void const* p) { return reinterpret_cast<std::uintptr_t>(p) % lina::detail::huge_page == 0; }
}  // namespace

// Fresh memory costs a page fault per page at its first touch: 4 KiB pages
// made cpu::gradient's fresh gradient tensors cost more than its arithmetic at
// B·H = 8, N = 16384 (lina/detail/allocate.hpp).
TEST_CASE("tensors and workspace buffers of 2 MiB or more start on a huge page and ask the kernel for huge pages") {
  tensor<float> t({1, 2, 1024, 512});  // 4 MiB
  cpu::buffer<double> b(std::size_t{1} << 18);  // 2 MiB
  cpu::buffer<float> small(1000);
  CHECK(on_huge_page_boundary(t.data()));
  CHECK(on_huge_page_boundary(b.get()));
  CHECK(reinterpret_cast<std::uintptr_t>(small.get()) % 64 == 0);
  std::string const mode = huge_page_mode();
  if (mode == "madvise" || mode == "always") {
    CHECK(huge_page_eligible(t.data()) == 1);
    CHECK(huge_page_eligible(b.get()) == 1);
  } else {
    MESSAGE("transparent huge pages are '", mode, "' here: whether the kernel may use them is not checked");
  }
}
#endif
