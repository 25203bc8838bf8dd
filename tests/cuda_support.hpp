// Helpers shared by the CUDA backend's test files (test_cuda.cpp, test_cuda_backward.cpp):
// the symbols, references, tolerances and device utilities both use. Each file uses a
// subset, so unused-function warnings are off for these internal helpers.
#pragma once

#include <doctest/doctest.h>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <lina/cpu.hpp>
#include <lina/cuda.hpp>
#include <lina/cuda/nvrtc.hpp>
#include <lina/lina.hpp>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <unistd.h>
#include "support.hpp"
#include "heap_counter.hpp"

using namespace lina;

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
namespace {

constexpr auto N = dim<"N">;
constexpr auto D = dim<"D">;  // dynamic, so shapes can be random
constexpr auto M = dim<"M">;
constexpr auto Q = input<"Q">(N, D);
constexpr auto K = input<"K">(N, D);
constexpr auto V = input<"V">(N, M);
// Cross-attention: K and V over another sequence (S rows) than Q.
constexpr auto S = dim<"S">;
constexpr auto Kx = input<"K">(S, D);
constexpr auto Vx = input<"V">(S, M);
// Stacked layers: layer 1's output is an operand of layer 2.
constexpr auto Q2 = input<"Q2">(N, D);
constexpr auto K2 = input<"K2">(N, D);
constexpr auto V2 = input<"V2">(N, M);
constexpr auto Vd = input<"V">(N, D);  // layer 1's values: its output is N x D, an operand of layer 2
constexpr auto L = input<"L">(N, D);   // layer 1's output, as the CPU reference binds it
constexpr auto layer1 = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * Vd;

// ‖a − ref‖₂ / ‖ref‖₂ (0 when both are empty or zero).
template <class A, class R>
double relative_rms(A const& a, R const& ref) {
  REQUIRE(a.shape() == ref.shape());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double d = static_cast<double>(a.data()[i]) - static_cast<double>(ref.data()[i]);
    num += d * d;
    den += static_cast<double>(ref.data()[i]) * static_cast<double>(ref.data()[i]);
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// The values a kernel reading dtype t sees: x rounded to t (nearest even).
tensor<float> rounded(tensor<float> const& x, cuda::dtype t) {
  tensor<float> r = x;
  for (std::size_t i = 0; i < r.size(); ++i) {
    float v = r.data()[i];
    if (t == cuda::dtype::bf16) r.data()[i] = cuda::from_bf16_bits(cuda::bf16_bits(v));
    if (t == cuda::dtype::f16) r.data()[i] = cuda::from_f16_bits(cuda::f16_bits(v));
  }
  return r;
}
tensor<double> widened(tensor<float> const& x) {
  tensor<double> r(x.shape());
  for (std::size_t i = 0; i < x.size(); ++i) r.data()[i] = x.data()[i];
  return r;
}
// The sums of a host cuda::state, or of a cpu::state's scan (after dense), as a tensor [B, H, C, W].
tensor<float> sums_of(cuda::state const& st) {
  tensor<float> r(st.shape());
  std::copy(st.data(), st.data() + st.size(), r.data());
  return r;
}
// Rows [from, to) of a [B, H, N, M] tensor, writable (a block of the output).
tensor_view<float> rows_of(tensor<float>& t, std::size_t from, std::size_t to) { return t.rows(from, to - from); }

// A tensor or view's elements in a tensor of contiguous strides (a gradient the
// CPU laid out like a broadcast input, a cpu::state's sums).
template <class X>
auto dense(X const& x) {
  tensor<std::remove_cvref_t<decltype(x(0, 0, 0, 0))>> r(x.shape());
  for (std::size_t i = 0; i < r.shape()[0]; ++i)
    for (std::size_t j = 0; j < r.shape()[1]; ++j)
      for (std::size_t a = 0; a < r.shape()[2]; ++a)
        for (std::size_t c = 0; c < r.shape()[3]; ++c) r(i, j, a, c) = x(i, j, a, c);
  return r;
}
tensor<float> sums_of(cpu::state<float> const& st) { return dense(st[0]); }
template <class G>
tensor<float> as_float(G const& x) {
  tensor<float> r(x.shape());
  for (std::size_t i = 0; i < x.size(); ++i) r.data()[i] = static_cast<float>(x.data()[i]);
  return r;
}

// Relative RMS tolerance of an emulated result against references computed
// from the same (rounded) inputs. Both sides then differ by fp32 summation
// order — about √(terms)·2⁻²⁴ relative, ≤ 1e-6 at these sizes — and by the
// rounding of the output to its dtype: nearest-even rounding errs by at most
// half an ulp, 2⁻⁹ relative for bf16 (8 bits of significand) and 2⁻¹² for
// fp16 (11 bits), with an RMS about half that. The tolerances are twice the
// worst case: 2⁻⁸ (bf16), 2⁻¹¹ (fp16), and 1e-5 for fp32 (the summation
// order alone, with room for cancellation in signed, unnormalised sums).
double tolerance(cuda::dtype out) {
  switch (out) {
    case cuda::dtype::bf16: return std::ldexp(1.0, -8);
    case cuda::dtype::f16: return std::ldexp(1.0, -11);
    default: return 1e-5;
  }
}

// The tensor cores' operand rounding (program.hpp, `precision`): unit
// roundoff 2⁻⁹ for bf16 operands, 2⁻¹¹ for tf32 (f16 programs); exact
// fp32 products round nothing.
double operand_roundoff(cuda::dtype in) {
  switch (in) {
    case cuda::dtype::bf16: return std::ldexp(1.0, -9);
    case cuda::dtype::f16: return std::ldexp(1.0, -11);
    default: return 0.0;
  }
}

// The relative RMS error a linear plan's backward on the tensor cores may have
// against the expression in double. Tensor-core products round every operand
// they read by u. A term of an unnormalised gradient carries at most four
// rounded factors (∂out or ĝ, [v|1] or φq, then the chunk's score and φk, or
// the state); a normalised one also rounds the recomputed rows (three
// factors) that ĝ divides by, twice (numerator and denominator): 4u and 10u on
// the RMS, plus the output's rounding.
double backward_mma_bound(cuda::dtype in, bool normalized) {
  return tolerance(in) + (normalized ? 10 : 4) * operand_roundoff(in);
}

// The plan a test runs: the linear order, or compile()'s plan for softmax
// (exp never linearises).
template <class Expr>
constexpr auto plan_of(Expr const& expr) {
  if constexpr (contains_op<Expr, op::exp>())
    return compile(expr);
  else
    return compile<order::linear>(expr);
}

// How far operand rounding may move a result, relative RMS: every term of an
// output's sums carries at most three rounded factors (φ(q), φ(k), and the
// chunk's score or the state), so it errs by at most 3u of its magnitude, and
// a normalised row divides two such sums: |error| ≤ 6u·Σ|terms| / |Σ a|.
// Σ|terms| is the same expression on magnitudes: |V|, and |Q|, |K| where the
// features are signed (identity, poly2 — whose features of |x| are the
// magnitudes of x's); elu+1 and relu features are ≥ 0 already. Softmax rounds
// one factor per term (exp of the score: q and k arrive in the input type,
// which the operand type holds exactly), so 2u·Σ exp·|v| / |Σ exp|.
template <class Expr>
double rounding_bound(Expr const& expr, cuda::dtype in, tensor<float> const& q, tensor<float> const& k,
                      tensor<float> const& v, tensor<double> const& exact) {
  double u = operand_roundoff(in);
  if (u == 0.0) return 0.0;
  auto const spec = cuda::spec_of(plan_of(expr));
  bool const signed_features =
      !spec.softmax && (spec.map_q == cuda::feature_map::identity || spec.map_q == cuda::feature_map::poly2);
  auto magnitude = [](tensor<float> const& x) {
    tensor<double> r(x.shape());
    for (std::size_t i = 0; i < x.size(); ++i) r.data()[i] = std::abs(static_cast<double>(x.data()[i]));
    return r;
  };
  auto terms = signed_features ? cpu::evaluate(expr, Q = magnitude(q), K = magnitude(k), V = magnitude(v))
                               : cpu::evaluate(expr, Q = widened(q), K = widened(k), V = magnitude(v));
  double num = 0, den = 0;
  for (std::size_t i = 0; i < terms.size(); ++i) num += terms.data()[i] * terms.data()[i];
  for (std::size_t i = 0; i < exact.size(); ++i) den += exact.data()[i] * exact.data()[i];
  return den == 0.0 ? 0.0 : (spec.softmax ? 2.0 : 6.0) * u * std::sqrt(num / den);
}

// The chained program of `plan` (what emulate_into with a state runs).
template <class Plan>
cuda::program chained_program(Plan const& plan, cuda::options opt, std::size_t d, std::size_t m, std::size_t f = 0) {
  auto s = cuda::spec_of(plan, opt);
  s.d = d;
  s.m = m;
  s.f = f;
  s.chained = true;
  return cuda::program_of(s);
}

// The barriers of an emitted kernel, read back from its source (not from the
// emitter's own bookkeeping): between two tile operations of which the second
// reads or writes a tile the first wrote, or writes one the first read (or
// global memory the kernel writes: a store, and a load from an extra buffer
// or a state), there is a __syncthreads() — in straight-line code, and
// around a chunk loop's back edge (its body walked twice). Tiles are the
// program's register names among a call's arguments; a call writes its first
// (exp_rows its first three), a store none but global memory (row_divide_store
// both). Returns the first pair without one ("" if none).
std::string unguarded_hazard(cuda::program const& p, std::string const& src) {
  std::set<std::string> names;
  for (auto const& r : p.registers) names.insert(r.name);
  struct op {
    std::string text;
    std::set<std::string> reads, writes;
    bool barrier = false;
  };
  auto trim = [](std::string x) {
    x.erase(0, x.find_first_not_of(' '));
    return x;
  };
  auto parse = [&](std::string const& line) {
    op o{line, {}, {}, line == "__syncthreads();"};
    if (o.barrier || line.rfind("tl::", 0) != 0) return o;
    std::string const fn = line.substr(4, line.find_first_of("<(") - 4);
    // the call's arguments: after the template arguments' closing '>' (or the name), to the matching ')'
    std::size_t at = line.find_first_of("<(");
    if (line[at] == '<')
      for (int depth = 0;; ++at) {
        depth += line[at] == '<' ? 1 : line[at] == '>' ? -1 : 0;
        if (depth == 0) break;
      }
    at = line.find('(', at);
    std::vector<std::string> args{""};
    for (int depth = 0; ++at < line.size();) {
      char const c = line[at];
      if (c == ')' && depth == 0) break;
      depth += c == '(' || c == '<' || c == '[' ? 1 : c == ')' || c == '>' || c == ']' ? -1 : 0;
      if (c == ',' && depth == 0)
        args.push_back("");
      else if (c != ' ')
        args.back() += c;
    }
    bool const store = fn == "store" || fn == "store_state" || fn == "store_partial";
    bool const to_global = store || fn == "row_divide_store";  // (which writes its tile too)
    int const writes = store || fn == "prefetch" ? 0 : fn == "exp_rows" ? 3 : 1;
    for (std::size_t a = 0; a < args.size(); ++a)
      if (names.count(args[a])) {
        o.reads.insert(args[a]);
        if (static_cast<int>(a) < writes) o.writes.insert(args[a]);
      }
    bool const reads_written = fn == "load_state" || fn == "add_partials" || line.find("args.extra") != std::string::npos ||
                               line.find("args.state_in") != std::string::npos;
    if (to_global) o.writes.insert("<global>"), o.reads.insert("<global>");
    if (reads_written && fn != "prefetch") o.reads.insert("<global>");
    return o;
  };
  // The kernel's body as nested blocks: a `for` line opens a loop (walked twice), other braces nest plainly.
  std::vector<std::string> lines;
  {
    std::istringstream in(src.substr(src.find("extern \"C\"")));
    for (std::string l; std::getline(in, l);) lines.push_back(trim(l.substr(0, l.find("  //"))));
  }
  std::set<std::string> reads, writes;  // since the last barrier
  std::string last, problem;  // (the last operation that touched a tile)
  std::size_t n = 1;  // (line 0: the signature)
  std::function<void(bool)> block = [&](bool loop) {
    std::size_t const first = n;
    for (int walk = 0; walk < (loop ? 2 : 1); ++walk) {
      n = first;
      while (n < lines.size() && lines[n] != "}") {
        std::string const& l = lines[n++];
        if (l.rfind("for (", 0) == 0) {
          block(true);
        } else if (l.size() > 0 && l.back() == '{') {
          block(false);
        } else {
          op const o = parse(l);
          if (o.barrier) {
            reads.clear(), writes.clear();
            continue;
          }
          auto meets = [](std::set<std::string> const& x, std::set<std::string> const& y) {
            return std::any_of(x.begin(), x.end(), [&](std::string const& v) { return y.count(v) > 0; });
          };
          if (problem.empty() && (meets(writes, o.reads) || meets(writes, o.writes) || meets(reads, o.writes)))
            problem = "no barrier between `" + last + "` (or an operation before it) and `" + l + "`";
          reads.insert(o.reads.begin(), o.reads.end());
          writes.insert(o.writes.begin(), o.writes.end());
          if (!o.writes.empty() || !o.reads.empty()) last = l;
        }
      }
    }
    ++n;  // (the closing brace)
  };
  block(false);
  return problem;
}

// Compile each distinct generated kernel for sm_80 and sm_90; any log fails.
// With --Ofast-compile=max: the same parsing, type checks and PTX code
// generation without most optimisation passes, which are most of a compile's
// time (a backward kernel: 0.2 s instead of 1.5 s). To PTX for both
// (compute_80, compute_90: NVRTC's parsing, checks and code generation for
// that architecture), without running the assembler, which was most of the
// rest: the tests' 499 kernels took 56 s to compute_90 PTX, 209 s to sm_90
// cubins (one core, 2026-12-03; 56 s to compute_80). The assembler checks an
// instruction's operands and a kernel's resources; the kernels' shared memory
// is dynamic (sized at launch, checked against the budget by the tests) and
// their registers are the assembler's to allocate, so what it could refuse is
// an instruction: tiles.cuh writes every architecture-specific one inline, and
// test_cuda.cpp assembles each of them for sm_80 and sm_90 ("every inline PTX
// instruction …"). With `as_launched`, sm_90 also takes the options a launch
// uses, to a cubin with optimisation and ptxas's report of its registers and
// local memory (below): the golden kernels and the ones scripts/gpu-check's
// benchmark launches.
// Through an on-disk cache in the build folder that the test processes share
// (ctest runs each test case alone, and many compile the same kernels: a
// fifth of the suite's NVRTC time); a kernel read back carries its log.
// What ptxas reports for a kernel (NVRTC's --ptxas-options=-v): its registers
// per thread, stack frame and spills; `other` collects any line that is not such
// a report (a warning), which must be empty like a quiet compile's log.
struct ptxas_report {
  int registers = -1;
  long stack = -1, spill_stores = -1, spill_loads = -1;
  std::string other;
};
ptxas_report read_ptxas_report(std::string const& log) {
  ptxas_report r;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    if (line.rfind("ptxas info    : ", 0) == 0 || line.rfind("ptxas         . ", 0) == 0) {
      std::sscanf(line.c_str(), "ptxas info : Used %d registers", &r.registers);
      std::sscanf(line.c_str(), "ptxas . %ld bytes stack frame, %ld bytes spill stores, %ld bytes spill loads", &r.stack,
                  &r.spill_stores, &r.spill_loads);
    } else {
      r.other += line + "\n";
    }
  }
  return r;
}

// The option that asks ptxas for its report (read_ptxas_report).
inline std::string const ptxas_report_option = "--ptxas-options=-v";

// One NVRTC compile (through the cache) that must succeed with an image and an
// empty log — apart from ptxas's report where the options ask for it.
cuda::compiled_kernel check_compile(std::string const& src, std::string const& kernel, std::string const& arch,
                                    std::vector<std::string> const& options) {
  CAPTURE(arch);
  CAPTURE(options.size());
  CAPTURE(kernel);
  cuda::compiled_kernel k;
  REQUIRE_NOTHROW(k = cuda::compile_cached_in(LINA_TEST_NVRTC_CACHE, src, kernel, arch, options));
  bool const reported = std::find(options.begin(), options.end(), ptxas_report_option) != options.end();
  CHECK((reported ? read_ptxas_report(k.log).other : k.log) == "");
  CHECK(!k.image.empty());
  return k;
}

// Blocks of a program that fit on one sm_90 SM at once: by shared memory (228 KiB an SM,
// 1 KiB more per block: program.hpp), by registers (64 Ki an SM, allocated per warp in
// units of 256) and by threads (2048).
struct occupancy {
  int by_shared, by_registers, by_threads;
  int blocks() const { return std::min({by_shared, by_registers, by_threads}); }
};
occupancy sm90_occupancy(cuda::program const& p, int registers) {
  int const warps = (p.tiles.threads + 31) / 32;
  int const per_warp = (registers * 32 + 255) / 256 * 256;
  return {static_cast<int>(cuda::sm90_shared_bytes_per_sm / (p.shared_bytes() + cuda::shared_bytes_reserved_per_block)),
          65536 / per_warp / warps, 2048 / p.tiles.threads};
}

void check_compiles(cuda::program const& p, bool as_launched = false) {
  static std::set<std::pair<std::string, bool>> done;
  std::string src = cuda::emit(p);
  if (!done.insert({src, as_launched}).second) return;
  CAPTURE(p.kernel_name);
  CHECK(unguarded_hazard(p, src) == "");
  struct target {
    std::string arch;
    std::vector<std::string> options;
  };
  std::vector<target> targets = {{"compute_80", {"--Ofast-compile=max"}}, {"compute_90", {"--Ofast-compile=max"}}};
  for (target const& t : targets) check_compile(src, p.kernel_name, t.arch, t.options);
  if (!as_launched) return;
  // Optimised for sm_90 as a launch compiles it, with ptxas's report: what a kernel
  // keeps in local memory stays a few scalars. A tile of accumulators or fragments
  // that no longer fits in registers spills hundreds of bytes, each a round trip
  // through L1 inside the products' loops; the kernels that spill today keep 2 to 7
  // scalars there (8–28 bytes: offsets and predicates from the thread's index,
  // computed once and reloaded a few times a chunk — six loads in a chunk of 2689
  // instructions in softmax's forward at D = 128 — and, in the split backward's third
  // launch, in the loop that adds later groups' sums; read in their sm_90 SASS with
  // cuobjdump, 2026-12-03).
  cuda::compiled_kernel const k = check_compile(src, p.kernel_name, "sm_90", {ptxas_report_option});
  ptxas_report const r = read_ptxas_report(k.log);
  CAPTURE(k.log);
  CHECK(r.registers > 0);
  CHECK(r.stack >= 0);  // (the report was read)
  CHECK(r.stack <= 32);
  CHECK(r.spill_stores <= 32);
  CHECK(r.spill_loads <= 32);
  occupancy const o = sm90_occupancy(p, r.registers);
  MESSAGE(p.kernel_name << ": " << r.registers << " registers, " << p.tiles.threads << " threads, " << p.shared_bytes()
                        << " bytes shared; blocks per SM " << o.blocks() << " (shared memory " << o.by_shared
                        << ", registers " << o.by_registers << ", threads " << o.by_threads << ")");
}

struct shape {
  std::size_t b, h, n, d, m;
  bool random = false;  // drawn at random: emulated, but its kernels are not compiled (NVRTC's time goes to the edge shapes)
};

// The fixed shapes whose tensor-core kernels compile too: the first and the
// widest D (the fp32 kernels compile at every fixed shape; the 16-bit ones
// differ from them in types and product instructions, not in shape logic).
bool tensor_core_edge(shape const& s, std::vector<shape> const& cases) {
  std::size_t widest = 0;
  for (shape const& c : cases)
    if (!c.random) widest = std::max(widest, c.d);
  return !s.random && (&s == &cases.front() || s.d == widest);
}

// poly2 has C = D(D+1)/2 features: D up to 20 (C = 210).
std::vector<shape> poly2_shapes() {
  return {{1, 1, 0, 3, 2}, {1, 2, 1, 4, 5}, {2, 1, 65, 8, 3}, {1, 1, 130, 13, 24}, {1, 1, 70, 20, 9}};
}

// `count` random shapes with N in [n_min, n_max], D ≤ 40, M ≤ 80 and M ≠ D, appended to s.
void add_random_shapes(std::vector<shape>& s, test::rng& r, int count, std::size_t n_min, std::size_t n_max) {
  for (int i = 0; i < count; ++i) {
    shape x{r.in(1, 2), r.in(1, 3), r.in(n_min, n_max), r.in(1, 40), 0, true};
    do x.m = r.in(1, 80);
    while (x.m == x.d);
    s.push_back(x);
  }
}

// Edge shapes first (N = 0, 1, a chunk ± 1; D ≠ M; non-powers of two up to
// 256, which take the smaller chunk), then random ones.
std::vector<shape> shapes(std::uint64_t seed, int random_count) {
  std::vector<shape> s = {{1, 1, 0, 5, 3},  {1, 2, 1, 7, 4},    {2, 1, 63, 16, 9},  {1, 1, 65, 48, 96},
                          {1, 1, 130, 96, 48}, {1, 1, 70, 200, 72}, {1, 1, 40, 256, 200}};
  test::rng r{seed};
  add_random_shapes(s, r, random_count, 0, 300);
  return s;
}

// Random Q, K ([B,H,N,D]; |·| when positive: poly2's features then stay
// away from cancellation) and V ([B,H,N,M]), as a kernel reading dtype t sees them.
struct qkv {
  tensor<float> q, k, v;
};
qkv random_inputs(shape const& s, cuda::dtype t, test::rng& r, bool positive) {
  auto q = tensor<float>::random({s.b, s.h, s.n, s.d}, r.next());
  auto k = tensor<float>::random({s.b, s.h, s.n, s.d}, r.next());
  if (positive)
    for (auto* x : {&q, &k})
      for (std::size_t i = 0; i < x->size(); ++i) x->data()[i] = std::abs(x->data()[i]);
  auto v = tensor<float>::random({s.b, s.h, s.n, s.m}, r.next());
  return {rounded(q, t), rounded(k, t), rounded(v, t)};
}

// The emulated kernel of plan_of(expr) against cpu::evaluate of the same plan
// and against the expression as written, in double, all on the inputs as the
// kernel reads them. The kernels of the first `compiled` fixed shapes compile
// (all of them by default).
template <class Expr>
void check_forward(Expr const& expr, std::uint64_t seed, std::vector<shape> const& fixed = {}, bool positive = false,
                   std::size_t compiled = SIZE_MAX) {
  auto const plan = plan_of(expr);
  static_assert(cuda::lowerable<decltype(plan)>);
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    double worst = 0, worst_mma = 0;
    test::rng r{seed};
    std::vector<shape> const cases = fixed.empty() ? shapes(seed, 3) : fixed;
    for (shape const& s : cases) {
      CAPTURE(cuda::name_of(dt));
      CONTEXT(s.b, s.h, s.n, s.d, s.m);
      auto [q, k, v] = random_inputs(s, dt, r, positive);
      // Exact fp32 products: within the output's rounding of both references.
      cuda::options opt{dt, dt, true};
      auto got = cuda::emulate(plan, opt, Q = q, K = k, V = v);
      auto cpu = cpu::evaluate(plan, Q = q, K = k, V = v);
      auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
      double e1 = relative_rms(got, cpu), e2 = relative_rms(got, exact);
      CHECK(e1 <= tolerance(dt));
      CHECK(e2 <= tolerance(dt));
      worst = std::max({worst, e1 / tolerance(dt), e2 / tolerance(dt)});
      // The kernels a launch would use (the tensor-core ones for 16-bit inputs)
      // compile at every shape; the exact-product variants at the first.
      bool const compiles = !s.random && static_cast<std::size_t>(&s - cases.data()) < compiled;
      if (compiles && (dt == cuda::dtype::f32 || &s == &cases.front()))
        check_compiles(cuda::program_of(plan, opt, D = s.d, M = s.m));
      if (dt != cuda::dtype::f32) {  // the tensor-core precision: within its operands' rounding too
        cuda::options fast{dt, dt};
        auto rounded_products = cuda::emulate(plan, fast, Q = q, K = k, V = v);
        double bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact);
        double e3 = relative_rms(rounded_products, exact);
        CAPTURE(bound);
        CHECK(e3 <= bound);
        worst_mma = std::max(worst_mma, e3 / bound);
        if (compiles && tensor_core_edge(s, cases)) check_compiles(cuda::program_of(plan, fast, D = s.d, M = s.m));
      }
    }
    std::string mma = dt == cuda::dtype::f32 ? "" : "; tensor-core products, error / bound: " + std::to_string(worst_mma);
    MESSAGE(cuda::name_of(dt) << ": largest relative RMS error / tolerance: " << worst << mma);
  }
}


// FAVOR+ and random Fourier features: W, D × F.
constexpr auto Fw = dim<"F">;
constexpr auto W = input<"W">(D, Fw);

// The 16-bit bit patterns of a float tensor (dense [B,H,N,C]).
std::vector<std::uint16_t> bits_of(tensor<float> const& x, cuda::dtype t) {
  std::vector<std::uint16_t> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    r[i] = t == cuda::dtype::bf16 ? cuda::bf16_bits(x.data()[i]) : cuda::f16_bits(x.data()[i]);
  return r;
}
cuda::device_buffer upload(tensor<float> const& x, cuda::dtype t) {
  cuda::device_buffer d(x.size() * cuda::size_of(t));
  if (t == cuda::dtype::f32)
    d.upload(x.data(), d.size());
  else
    d.upload(bits_of(x, t).data(), d.size());
  return d;
}

// Elements of type dt (dense, of this shape) as floats: from device memory or from host bits.
tensor<float> widened_from(std::vector<std::uint16_t> const& bits, cuda::dtype dt, shape4 shape) {
  tensor<float> r(shape);
  for (std::size_t i = 0; i < bits.size(); ++i)
    r.data()[i] = dt == cuda::dtype::bf16 ? cuda::from_bf16_bits(bits[i]) : cuda::from_f16_bits(bits[i]);
  return r;
}
tensor<float> widened_from(cuda::device_buffer const& d, cuda::dtype dt, shape4 shape) {
  tensor<float> r(shape);
  if (dt == cuda::dtype::f32) {
    d.download(r.data(), r.size() * 4);
    return r;
  }
  std::vector<std::uint16_t> bits(r.size());
  d.download(bits.data(), bits.size() * 2);
  return widened_from(bits, dt, shape);
}

// A kernel run another way than the emulation — launched on a device, or as
// written on the host (test_cuda_simt.cpp) — against the emulation: fp32, the
// same fma chains but another expf (the device's, or the host's against its
// exp) by a few ulps; 16-bit, the tensor cores summing in their own order.
double forward_tolerance(cuda::dtype dt) { return dt == cuda::dtype::f32 ? 1e-6 : tolerance(dt) / 4; }
double gradient_tolerance(cuda::dtype dt) { return dt == cuda::dtype::f32 ? 1e-5 : tolerance(dt) / 2; }

// One launch of `plan`'s kernel on the device against its emulation.
template <class Plan>
void launch_vs_emulation(Plan const& plan, cuda::dtype dt, shape s, std::uint64_t seed) {
  CONTEXT(cuda::name_of(dt), s.n, s.d, s.m);
  auto q = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed), dt);
  auto k = rounded(tensor<float>::random({s.b, s.h, s.n, s.d}, seed + 1), dt);
  auto v = rounded(tensor<float>::random({s.b, s.h, s.n, s.m}, seed + 2), dt);
  auto want = cuda::emulate(plan, {dt, dt}, Q = q, K = k, V = v);
  auto dq = upload(q, dt), dk = upload(k, dt), dv = upload(v, dt);
  cuda::device_buffer dout(want.size() * cuda::size_of(dt));
  shape4 sq{s.b, s.h, s.n, s.d}, sv{s.b, s.h, s.n, s.m};
  auto go = [&]<class E>() {
    cuda::evaluate_into(plan, cuda::device_view<E>(static_cast<E*>(dout.get()), sv), nullptr,
                        Q = cuda::device_view<E const>(static_cast<E const*>(dq.get()), sq),
                        K = cuda::device_view<E const>(static_cast<E const*>(dk.get()), sq),
                        V = cuda::device_view<E const>(static_cast<E const*>(dv.get()), sv));
  };
  if (dt == cuda::dtype::f32) go.template operator()<float>();
  if (dt == cuda::dtype::bf16) go.template operator()<cuda::bf16>();
  if (dt == cuda::dtype::f16) go.template operator()<cuda::f16>();
  cuda::synchronize();
  tensor<float> const got = widened_from(dout, dt, want.shape());
  CHECK(relative_rms(got, want) <= forward_tolerance(dt));
}
constexpr auto causal_expr = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
constexpr auto full_expr = normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V;
constexpr auto softmax_expr = normalize(causal(exp(Q * transpose(K) * 0.125))) * V;
// check(plan, dtype, shape, seed) for the forward cases the device test launches
// (and the host run of the kernels as written): causal and non-causal linear,
// causal softmax; every dtype; N = 1 to 200, D and M up to 256.
template <class F>
void for_each_launch_case(F&& check) {
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16})
    for (shape s : {shape{2, 3, 1, 16, 8}, shape{1, 2, 200, 64, 64}, shape{1, 1, 130, 96, 200}, shape{1, 1, 70, 256, 48}}) {
      check(compile<order::linear>(causal_expr), dt, s, 100);
      check(compile<order::linear>(full_expr), dt, s, 200);
      check(compile(softmax_expr), dt, s, 300);
    }
}
// f(plan, the bindings among b... that plan reads).
template <class Plan, class F, class... B>
auto on_inputs_of(Plan const& plan, F&& f, B const&... b) {
  return cuda::detail::with_inputs_of<Plan>([&](auto const&... kept) { return f(plan, kept...); }, b...);
}
template <class E>
cuda::dtype dtype_for() {
  return cuda::dtype_of<E>;
}
// Views of [B, rows, H, C] storage (filled with 7s), one per gradient of g,
// shaped as g's: into, as emulate_gradient_into wants it.
template <class G, class Want>
G bnhc_views(G into, Want const& g, std::vector<std::vector<float>>& store) {
  store.resize(g.all().size());
  for (std::size_t i = 0; i < g.all().size(); ++i) {
    shape4 const sh = g.all()[i].shape();
    auto const h = static_cast<std::ptrdiff_t>(sh[1]), rows = static_cast<std::ptrdiff_t>(sh[2]),
               c = static_cast<std::ptrdiff_t>(sh[3]);
    store[i].assign(sh[0] * sh[1] * sh[2] * sh[3], 7.f);
    into.all()[i] = tensor_view<float>(store[i].data(), sh, {rows * h * c, c, h * c, 1});
  }
  return into;
}

}  // namespace

// A device test without a device says so in the words ctest counts as skipped.
inline bool skipped_without(cuda::device_status const& dev) {
  if (dev.available) return false;
  MESSAGE("skipped: no CUDA device (" << dev.reason << ")");
  return true;
}
#pragma GCC diagnostic pop
