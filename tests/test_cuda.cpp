// The CUDA backend without a GPU, its machinery: fp16/bf16 rounding, plans →
// tile programs, the emitted sources of a few plans pinned by golden files
// (tests/golden/), NVRTC (errors, the on-disk cache), and the device tests
// (reported as skipped where there is no GPU). The properties of the kernels
// are in test_cuda_forward.cpp, test_cuda_backward.cpp, test_cuda_parametric.cpp
// (favor, random Fourier features), test_cuda_cross_stacked.cpp and
// test_cuda_state.cpp (chained, recurrent, split): six files, so that the
// build's two jobs share them evenly.
//
// Regenerate the golden files after an intended change of the emitter with
//   LINA_UPDATE_GOLDEN=1 build/release/tests/lina_cuda_tests -tc="*golden*"
// and review the diff.
#include "cuda_support.hpp"
#include <lina/cuda/tiles.cuh>
#include <regex>

TEST_CASE("numeric: fp16 and bf16 conversions round to nearest even") {
  using namespace lina::cuda;
  // Every finite 16-bit value converts to fp32 and back unchanged.
  for (std::uint32_t u = 0; u < 0x10000u; ++u) {
    auto h = static_cast<std::uint16_t>(u);
    if ((h & 0x7c00u) != 0x7c00u) REQUIRE(f16_bits(from_f16_bits(h)) == h);
    if ((h & 0x7f80u) != 0x7f80u) REQUIRE(bf16_bits(from_bf16_bits(h)) == h);
  }
  CHECK(from_f16_bits(f16_bits(1.0f + 0x1p-11f)) == 1.0f);                  // tie → even (down)
  CHECK(from_f16_bits(f16_bits(1.0f + 3 * 0x1p-11f)) == 1.0f + 0x1p-9f);   // tie → even (up)
  CHECK(from_bf16_bits(bf16_bits(1.0f + 0x1p-8f)) == 1.0f);
  CHECK(from_bf16_bits(bf16_bits(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);
  CHECK(from_f16_bits(f16_bits(65520.0f)) == INFINITY);   // rounds past the largest half
  CHECK(from_f16_bits(f16_bits(65519.0f)) == 65504.0f);
  CHECK(from_f16_bits(f16_bits(0x1p-25f)) == 0.0f);       // half the smallest subnormal: tie → 0
  CHECK(from_f16_bits(f16_bits(0x1.8p-25f)) == 0x1p-24f);
  CHECK(from_f16_bits(f16_bits(0x1.7fep-15f)) == 0x1.8p-15f);  // a subnormal half
  CHECK(std::isnan(from_bf16_bits(bf16_bits(NAN))));
  CHECK(std::isnan(from_f16_bits(f16_bits(NAN))));
}

// The lane arithmetic of tiles.cuh's tensor-core products (its host-compilable
// part), against the PTX ISA's description of the instructions: ldmatrix gives
// thread t, for each 8 × 8 matrix m, the pair at row t / 4, columns 2(t % 4) and
// 2(t % 4) + 1 of the matrix whose rows lanes 8m … 8m + 7 point at (.trans: the
// pair at column t / 4 of rows 2(t % 4), 2(t % 4) + 1). Each register must hold
// the pair of elements the mma.m16n8k16 fragment (mma16::a_row, a_k, b_k, b_col)
// puts there — for operands stored either way — and every row address must be
// 16-byte aligned (bf16 pitches are multiples of 8 elements).
TEST_CASE("tile fragments: ldmatrix's rows give mma.m16n8k16's bf16 fragments, either storage order") {
  using lina::tile::mma16;
  for (int const pitch : {24, 40, 72, 136})
    for (int const origin : {0, 8, 16})  // the fragment's first row (or column); its first k is origin + 16
    for (bool const k_major : {false, true}) {  // k along the stored rows (a transposed A, a non-transposed B)
      CAPTURE(pitch);
      CAPTURE(origin);
      CAPTURE(k_major);
      // The element at (row or column "outer", k) of the fragment, as an offset in its register.
      auto offset = [&](int outer, int k) {
        return k_major ? (origin + 16 + k) * pitch + origin + outer : (origin + outer) * pitch + origin + 16 + k;
      };
      // ldmatrix's register m of thread t: the offsets of its two elements.
      auto loaded = [&](bool x4, int t, int m) {
        auto row = [&](int lane) { return mma16::ldmatrix_offset(lane, x4, k_major, pitch, origin, origin + 16); };
        return k_major ? std::pair{row(8 * m + 2 * (t % 4)) + t / 4, row(8 * m + 2 * (t % 4) + 1) + t / 4}
                       : std::pair{row(8 * m + t / 4) + 2 * (t % 4), row(8 * m + t / 4) + 2 * (t % 4) + 1};
      };
      for (int lane = 0; lane < 32; ++lane) {
        CAPTURE(lane);
        CHECK(mma16::ldmatrix_offset(lane, true, k_major, pitch, origin, origin + 16) % 8 == 0);
        CHECK(mma16::ldmatrix_offset(lane, false, k_major, pitch, origin, origin + 16) % 8 == 0);
        for (int r = 0; r < 4; ++r) {  // A (16 × 16): rows of A are "outer"
          int const i = mma16::a_row(lane, r), k = mma16::a_k(lane, r);
          CHECK(loaded(true, lane, r) == std::pair{offset(i, k), offset(i, k + 1)});
        }
        for (int r = 0; r < 2; ++r) {  // B (16 × 8): columns of B are "outer"
          int const j = mma16::b_col(lane), k = mma16::b_k(lane, r);
          CHECK(loaded(false, lane, r) == std::pair{offset(j, k), offset(j, k + 1)});
        }
      }
    }
  // The fragments cover each operand element once, and the accumulator's 16 × 8 once.
  std::set<std::pair<int, int>> a, b, c;
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r) {
      for (int e : {0, 1}) a.insert({mma16::a_row(lane, r), mma16::a_k(lane, r) + e});
      if (r < 2)
        for (int e : {0, 1}) b.insert({mma16::b_k(lane, r) + e, mma16::b_col(lane)});
      c.insert({mma16::c_row(lane, r), mma16::c_col(lane, r)});
    }
  CHECK(a.size() == 256);
  CHECK(b.size() == 128);
  CHECK(c.size() == 128);
  CHECK(std::all_of(a.begin(), a.end(), [](auto e) { return e.first < 16 && e.second < 16; }));
  CHECK(std::all_of(b.begin(), b.end(), [](auto e) { return e.first < 16 && e.second < 8; }));
  CHECK(std::all_of(c.begin(), c.end(), [](auto e) { return e.first < 16 && e.second < 8; }));
}

// The fragments tiles.cuh reads element by element (fp32 registers, and any
// whole fragment it need not test) take one address per lane and one offset
// per register (mma16::lane_offset, a_register_offset, b_register_offset):
// those must name the elements the fragment layouts put there — m16n8k16's
// (a_row, a_k, b_k, b_col; a pair, the second one step along k further) and,
// from the PTX ISA, m16n8k8 tf32's (A: rows g, g + 8 × columns q, q + 4; B:
// rows q, q + 4 × column g; g = lane / 4, q = lane % 4) — stored either way.
TEST_CASE("tile fragments: element-wise reads at one address per lane give the mma fragments, either storage order") {
  using lina::tile::mma16;
  for (int const pitch : {12, 68, 76, 136})
    for (bool const k_major : {false, true}) {  // k along the stored rows
      CAPTURE(pitch);
      CAPTURE(k_major);
      int const outer = k_major ? 1 : pitch, k = k_major ? pitch : 1;  // steps, in elements
      auto at = [&](int o, int kk) { return o * outer + kk * k; };
      for (int lane = 0; lane < 32; ++lane) {
        CAPTURE(lane);
        int const g = lane / 4, q = lane % 4;
        for (int r = 0; r < 4; ++r) {
          CAPTURE(r);
          int const a16 = mma16::lane_offset(lane, outer, k, true) + mma16::a_register_offset(r, outer, k, true);
          CHECK(a16 == at(mma16::a_row(lane, r), mma16::a_k(lane, r)));
          CHECK(a16 + k == at(mma16::a_row(lane, r), mma16::a_k(lane, r) + 1));
          int const a8 = mma16::lane_offset(lane, outer, k, false) + mma16::a_register_offset(r, outer, k, false);
          CHECK(a8 == at(g + (r & 1) * 8, q + (r >> 1) * 4));
          if (r < 2) {
            int const b16 = mma16::lane_offset(lane, outer, k, true) + mma16::b_register_offset(r, k, true);
            CHECK(b16 == at(mma16::b_col(lane), mma16::b_k(lane, r)));
            CHECK(b16 + k == at(mma16::b_col(lane), mma16::b_k(lane, r) + 1));
            int const b8 = mma16::lane_offset(lane, outer, k, false) + mma16::b_register_offset(r, k, false);
            CHECK(b8 == at(g, q + r * 4));
          }
        }
      }
    }
}

// A user-defined map with no CUDA formulas: the CPU runs it, the kernels cannot.
struct host_only {
  static constexpr std::string_view name = "host_only";
  template <class T> static T value(T x) { return x * x; }
  template <class T> static T derivative(T x) { return 2 * x; }
};

TEST_CASE("plans → tile programs: supported shapes, chunk and tile sizes") {
  constexpr auto causal_plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  constexpr auto full_plan = compile<order::linear>(normalize(phi<relu>(Q) * transpose(phi<relu>(K))) * V);
  constexpr auto automatic = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  static_assert(cuda::lowerable<decltype(causal_plan)> && cuda::lowerable<decltype(full_plan)>);
  static_assert(cuda::lowerable<decltype(automatic)>);  // a select between the two orders of one attention
  static_assert(cuda::lowerable<decltype(compile<order::linear>(Q * transpose(K) * V))>);
  static_assert(cuda::lowerable<decltype(compile(normalize(exp(Q * transpose(K))) * V))>);  // softmax: quadratic
  static_assert(cuda::lowerable<decltype(compile(normalize(exp(causal(Q * transpose(K)))) * V))>);  // exp(0) = 1 above the diagonal
  static_assert(cuda::lowerable<decltype(compile<order::linear>(normalize(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V))>);
  constexpr auto W = input<"W">(D, dim<"F">);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // parametric maps, one W
                    normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V))>);
  constexpr auto W2 = input<"W2">(D, dim<"F">);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // a W for Q and another for K
                    normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W2)))) * V))>);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // a user-defined map with its CUDA formulas
                    normalize(causal(phi<test::softplus>(Q) * transpose(phi<test::softplus>(K)))) * V))>);
  static_assert(!cuda::lowerable<decltype(compile<order::linear>(  // … without them
                    normalize(causal(phi<host_only>(Q) * transpose(phi<host_only>(K)))) * V))>);
  static_assert(cuda::lowerable<decltype(compile<order::linear>(  // a decayed mask (retention), either order
                    normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)), decay{0.9})) * V))>);
  static_assert(cuda::lowerable<decltype(compile<order::quadratic>(causal(Q * transpose(K), decay{0.9}) * V))>);
  static_assert(cuda::lowerable<decltype(compile(causal(Q * transpose(K), decay{0.9}) * V))>);  // (a select)
  static_assert(cuda::lowerable<decltype(compile(  // a decayed softmax (ALiBi's bias)
                    normalize(causal(exp(Q * transpose(K)), decay{0.9})) * V))>);
  static_assert(!cuda::lowerable<decltype(compile(  // … but not a decayed mask inside exp: the CPU's
                    normalize(exp(causal(Q * transpose(K), decay{0.9}))) * V))>);

  auto s = cuda::spec_of(causal_plan);
  CHECK(s.causal);
  CHECK(s.normalized);
  CHECK(s.map_q == cuda::feature_map::elu_plus_one);
  CHECK(s.eps == 1e-6);
  CHECK(s.description == "rowdiv(contract(φ[elu+1](Q), prefix(φ[elu+1](K)⊗[V|1])))");
  CHECK(!cuda::spec_of(full_plan).causal);
  CHECK(cuda::spec_of(automatic).causal);

  // poly2 is a row map even at D = 1, where it has as many features as columns (x²).
  auto one = cuda::program_of(compile<order::linear>(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V), {}, D = 1, M = 2);
  CHECK(std::count_if(one.passes[0].begin(), one.passes[0].end(),
                      [](cuda::instruction const& i) { return i.op == cuda::opcode::map && i.a >= 0; }) == 2);
  auto q1 = tensor<float>::random({1, 1, 9, 1}, 1), v1 = tensor<float>::random({1, 1, 9, 2}, 2);
  auto poly2_d1 = compile<order::linear>(causal(phi<poly2>(Q) * transpose(phi<poly2>(K))) * V);
  CHECK(relative_rms(cuda::emulate(poly2_d1, Q = q1, K = q1, V = v1), cpu::evaluate(poly2_d1, Q = q1, K = q1, V = v1)) <= 1e-6);

  auto p = cuda::program_of(causal_plan, {}, D = 64, M = 64);
  CHECK(p.tiles.chunk == 64);
  CHECK(p.tiles.tile_m == 64);
  CHECK(p.m_tiles == 1);
  CHECK(p.shared_bytes() <= cuda::shared_memory_budget);
  auto wide = cuda::program_of(causal_plan, {}, D = 256, M = 200);
  CHECK(wide.tiles.chunk == 32);  // 64 rows of φ(Q), φ(K) and a 256 × 65 state do not fit
  CHECK(wide.m_tiles == 4);
  CHECK(wide.shared_bytes() <= cuda::shared_memory_budget);
  CHECK_THROWS_WITH_AS(cuda::program_of(causal_plan, {}, D = 64), doctest::Contains("dimension M"), std::invalid_argument);
  // Beyond what a block's shared memory holds even at T = 16: refused, saying why.
  CHECK_THROWS_WITH_AS(cuda::program_of(causal_plan, {}, D = 1500, M = 64), doctest::Contains("too large"),
                       std::invalid_argument);
  // compile()'s select between the two orders is the same kernel as the linear plan.
  auto q = tensor<float>::random({1, 2, 90, 7}, 1), k = tensor<float>::random({1, 2, 90, 7}, 2),
       v = tensor<float>::random({1, 2, 90, 5}, 3);
  CHECK(cuda::emit(cuda::program_of(automatic, {}, D = 7, M = 5)) == cuda::emit(cuda::program_of(causal_plan, {}, D = 7, M = 5)));
  CHECK(max_abs_diff(cuda::emulate(automatic, Q = q, K = k, V = v), cuda::emulate(causal_plan, Q = q, K = k, V = v)) == 0.0);
  MESSAGE(cuda::listing(p));
}

namespace {
// The emitted source of program p equals tests/golden/<file> byte for byte.
void check_golden(cuda::program const& p, std::string const& file) {
  std::string src = cuda::emit(p);
  std::string const path = std::string(LINA_GOLDEN_DIR) + "/" + file;
  if (char const* update = std::getenv("LINA_UPDATE_GOLDEN"); update && *update) {
    std::ofstream(path, std::ios::binary) << src;
    MESSAGE("rewrote " << path);
  }
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "missing golden file " << path << " (LINA_UPDATE_GOLDEN=1 writes it)");
  std::stringstream want;
  want << in.rdbuf();
  CHECK_MESSAGE(src == want.str(), "the emitted source differs from " << path
                                   << "; if the change is intended, rerun with LINA_UPDATE_GOLDEN=1 and review the diff");
  check_compiles(p, true);
}
// The emitted source of `plan` (static extents) equals tests/golden/<file>.
template <class Plan>
void check_golden(Plan const& plan, cuda::options opt, std::string const& file) {
  CHECK(cuda::source(plan, opt) == cuda::emit(cuda::program_of(plan, opt)));
  check_golden(cuda::program_of(plan, opt), file);
}
}  // namespace

// Which registers a program stores as bf16 (program.cpp, narrow_registers):
// those only bf16 tensor-core products read — their operands round to bf16 as
// they are read anyway — and that other instructions only write (loads of
// bf16 inputs, maps, masks, products that do not accumulate). Never a sum, a
// gradient or what another instruction reads; none in fp32 or f16 programs.
// Half the bytes lets the backward at D = M = 128 take chunks of 32 rows
// where fp32 tiles need 16.
// program_of and the backward's keep the programs of the last specs asked for
// (a launch asks at every call): asked again, before or after the entry was
// pushed out by newer ones, a spec gets the program it got the first time.
TEST_CASE("plans → tile programs: a spec asked for again gets the same program, kept or built again") {
  auto s = cuda::spec_of(compile<order::linear>(causal_expr));
  std::vector<cuda::program> forward, backward;
  for (std::size_t d = 1; d <= 40; ++d) {  // more specs than are kept
    s.d = s.m = d;
    forward.push_back(cuda::program_of(s));
    backward.push_back(cuda::backward_programs_of(s).front());
  }
  CHECK(forward[0] != forward[1]);
  CHECK(forward[0].kernel_name != forward[1].kernel_name);
  for (std::size_t d = 40; d >= 1; --d) {
    CAPTURE(d);
    s.d = s.m = d;
    CHECK(cuda::program_of(s) == forward[d - 1]);
    CHECK(cuda::backward_programs_of(s).front() == backward[d - 1]);
  }
  s.d = s.m = 5;  // (just asked for: kept)
  s.causal = false;  // another field than the extents
  CHECK(cuda::program_of(s).kernel_name.starts_with("lina_full"));
}

TEST_CASE("registers stored as bf16: the operands that only bf16 products read") {
  auto bf16_registers = [](cuda::program const& p) {
    std::set<std::string> r;
    for (cuda::tile_register const& x : p.registers)
      if (x.storage == cuda::dtype::bf16) r.insert(x.name);
    // The rule, checked on the result: any instruction reading a bf16 register
    // is an mma_bf16 product reading it as an operand, or a map in place.
    cuda::for_each_instruction(p, [&](cuda::instruction const& i) {
      auto bf16 = [&](int x) { return x >= 0 && p.registers[static_cast<std::size_t>(x)].storage == cuda::dtype::bf16; };
      CAPTURE(cuda::name_of(i.op));
      if (i.op == cuda::opcode::product) {
        if (bf16(i.dst)) CHECK_FALSE(i.accumulate);
        if (bf16(i.a) || bf16(i.b)) CHECK(i.prec == cuda::precision::mma_bf16);
      } else {
        CHECK_FALSE(bf16(i.a));
        CHECK_FALSE(bf16(i.b));
        if (bf16(i.dst))
          CHECK((i.op == cuda::opcode::load || i.op == cuda::opcode::map || i.op == cuda::opcode::zero ||
                 i.op == cuda::opcode::ones_column || i.op == cuda::opcode::mask_causal ||
                 i.op == cuda::opcode::mask_anticausal));
      }
    });
    return r;
  };
  using names = std::set<std::string>;
  cuda::attention_spec s;
  s.map_q = s.map_k = cuda::feature_map::elu_plus_one;
  s.d = s.m = 128;
  s.in = s.out = cuda::dtype::bf16;
  CHECK(bf16_registers(cuda::program_of(s)) == names{"q", "k", "v", "a"});  // a: the chunk's masked scores
  cuda::program const backward = cuda::backward_program_of(s);
  CHECK(bf16_registers(backward) == names{"q", "k", "v", "a"});
  CHECK(backward.tiles.chunk == 32);
  CHECK(backward.shared_bytes() <= cuda::shared_memory_budget);
  std::size_t wide = 0;  // the same registers in fp32
  for (cuda::tile_register r : backward.registers) wide += (r.storage = cuda::dtype::f32, r.rows * r.pitch() * 4);
  CHECK(wide > cuda::shared_memory_budget);
  for (cuda::program const& p : cuda::split_backward_programs_of(s)) CHECK(bf16_registers(p).count("state") == 0);
  for (cuda::program const& p : cuda::backward_programs_of([&] {
         auto x = s;
         x.softmax = true, x.scale = 0.125, x.map_q = x.map_k = cuda::feature_map::identity;
         return x;
       }()))
    CHECK(bf16_registers(p).count("g") == 0);
  // FAVOR+: W is a forward product's operand alone; the backward's param_grad reads it too.
  auto f = s;
  f.map_q = f.map_k = cuda::feature_map::favor, f.f = 32, f.d = f.m = 32;
  CHECK(bf16_registers(cuda::program_of(f)) == names{"q", "k", "v", "w", "a"});
  CHECK(bf16_registers(cuda::backward_program_of(f)) == names{"q", "k", "v", "a"});
  f.causal = false;  // no scores: the state and the rows are sums
  CHECK(bf16_registers(cuda::program_of(f)) == names{"q", "k", "v", "w"});
  for (auto dt : {cuda::dtype::f32, cuda::dtype::f16}) {
    auto x = s;
    x.in = x.out = dt;
    CHECK(bf16_registers(cuda::program_of(x)).empty());
    CHECK(bf16_registers(cuda::backward_program_of(x)).empty());
  }
  s.exact_products = true;  // fp32 FMA products of bf16 inputs read the registers exactly
  CHECK(bf16_registers(cuda::backward_program_of(s)).empty());
}

// A causal chunk's products that a mask follows or reads (program.cpp,
// skip_masked_tiles) compute only the mask's triangle of 16-row tiles: the
// scores past it are 0 without a product, and the product reading them skips
// those k tiles. Past the diagonal's stripe no term is computed, so a NaN in V
// reaches no row of an earlier stripe of its chunk (0·NaN was NaN); the
// property tests show the finite results unchanged.
TEST_CASE("masked products compute one triangle of tiles: a NaN of V stays out of earlier stripes") {
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  auto triangles = [](cuda::program const& p) {
    std::vector<std::pair<cuda::triangle, cuda::triangle>> r;
    cuda::for_each_instruction(p, [&](cuda::instruction const& i) {
      if (i.op == cuda::opcode::product && (i.tri_t != cuda::triangle::none || i.tri_a != cuda::triangle::none))
        r.push_back({i.tri_t, i.tri_a});
    });
    return r;
  };
  using tri = cuda::triangle;
  using pairs = std::vector<std::pair<tri, tri>>;
  cuda::attention_spec s = cuda::spec_of(causal_plan);
  s.d = 16, s.m = 8;
  CHECK(triangles(cuda::program_of(s)) == pairs{{tri::lower, tri::none}, {tri::none, tri::lower}});  // a = q·kᵀ; o = a·v
  CHECK(cuda::listing(cuda::program_of(s)).find("a = q·kᵀ (fma_f32, a's lower tiles alone)") != std::string::npos);
  // The backward: the forward walk's a = q·kᵀ, o = a·v, a = g·vᵀ, dx = a·k; the
  // reverse walk's a = v·gᵀ, dx = a·q, a = k·qᵀ, o = a·g under the anticausal mask.
  CHECK(triangles(cuda::backward_program_of(s)) ==
        pairs{{tri::lower, tri::none}, {tri::none, tri::lower}, {tri::lower, tri::none}, {tri::none, tri::lower},
              {tri::upper, tri::none}, {tri::none, tri::upper}, {tri::upper, tri::none}, {tri::none, tri::upper}});
  s.causal = false;
  CHECK(triangles(cuda::program_of(s)).empty());
  CHECK(triangles(cuda::backward_program_of(s)).empty());

  shape const sh{1, 1, 100, 16, 8};
  test::rng r{46};
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    CAPTURE(cuda::name_of(dt));
    auto [q, k, v] = random_inputs(sh, dt, r, false);
    std::size_t const bad = 20;  // row 4 of the chunk's second stripe
    v(0, 0, bad, 3) = std::nanf("");
    auto const o = cuda::emulate(causal_plan, {dt, cuda::dtype::f32}, Q = q, K = k, V = v);
    for (std::size_t i = 0; i < sh.n; ++i) {
      CAPTURE(i);
      CHECK(std::isnan(o(0, 0, i, 3)) == (i >= 16));  // rows 16–19: the diagonal stripe's 0·NaN
    }
  }
}

TEST_CASE("golden: the emitted sources of a few small plans") {
  constexpr auto Ds = dim<"D", 16>;
  constexpr auto Ms = dim<"M", 8>;
  constexpr auto Qs = input<"Q">(N, Ds);
  constexpr auto Ks = input<"K">(N, Ds);
  constexpr auto Vs = input<"V">(N, Ms);
  check_golden(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs),
               {cuda::dtype::bf16, cuda::dtype::bf16}, "cuda_causal_elu1_d16_m8_bf16.cu");
  check_golden(compile<order::linear>(phi<relu>(Qs) * transpose(phi<relu>(Ks)) * Vs), {cuda::dtype::f16, cuda::dtype::f32},
               "cuda_full_relu_d16_m8_f16_f32_unnormalized.cu");
  constexpr auto Dp = dim<"D", 4>;
  constexpr auto Qp = input<"Q">(N, Dp);
  constexpr auto Kp = input<"K">(N, Dp);
  check_golden(compile<order::linear>(normalize(causal(phi<poly2>(Qp) * transpose(phi<poly2>(Kp)))) * Vs), {},
               "cuda_causal_poly2_d4_m8_f32.cu");
  // Chained: the state loaded before the chunks and stored after them.
  check_golden(chained_program(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs),
                               {cuda::dtype::bf16, cuda::dtype::bf16}, 16, 8),
               "cuda_causal_elu1_d16_m8_bf16_state.cu");
  // Backward: a forward pass (rows again, rowdiv's adjoint, ∂Q) and a reverse pass (∂K, ∂V).
  auto spec = cuda::spec_of(compile<order::linear>(normalize(causal(phi<elu_plus_one>(Qs) * transpose(phi<elu_plus_one>(Ks)))) * Vs),
                            {cuda::dtype::bf16, cuda::dtype::bf16});
  check_golden(cuda::backward_program_of(spec), "cuda_causal_backward_elu1_d16_m8_bf16.cu");
  // Softmax: a block per chunk of query rows, the key chunks up to it, a running max.
  check_golden(compile(normalize(causal(exp(Qs * transpose(Ks) * 0.25))) * Vs), {cuda::dtype::bf16, cuda::dtype::bf16},
               "cuda_softmax_causal_d16_m8_bf16.cu");
  // Its backward: ∂Q per chunk of query rows (the rows again, ĝ and the shift stored), then ∂K, ∂V per chunk of key rows.
  auto const softmax_backward =
      cuda::backward_programs_of(cuda::spec_of(compile(normalize(causal(exp(Qs * transpose(Ks) * 0.25))) * Vs),
                                               {cuda::dtype::bf16, cuda::dtype::bf16}));
  check_golden(softmax_backward.at(0), "cuda_softmax_causal_backward_q_d16_m8_bf16.cu");
  check_golden(softmax_backward.at(1), "cuda_softmax_causal_backward_kv_d16_m8_bf16.cu");
}

// The kernels scripts/gpu-check's benchmark launches first compile here, so a
// device session is not spent finding an NVRTC error.
TEST_CASE("the benchmark's kernels (bench/cuda_forward.cpp: forward, backward, steps) compile for sm_80 and sm_90") {
  constexpr auto plan = compile<order::linear>(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  cuda::options const bf16{cuda::dtype::bf16, cuda::dtype::bf16};
  for (std::size_t d : {128, 64}) {
    CAPTURE(d);
    // As launched (optimised) at D = 128 only, where ptxas has the fewest registers to spare; the
    // D = 64 kernels are the same code with smaller constants (scripts/gpu-prebuild compiles all
    // of them optimised), and their optimised compiles took 12 of this test's 41 s.
    bool const launched = d == 128;
    auto p = cuda::program_of(plan, bf16, D = d, M = d);
    CHECK(p.shared_bytes() <= cuda::shared_memory_budget);
    check_compiles(p, launched);
    check_compiles(chained_program(plan, bf16, d, d), launched);
    auto spec = cuda::spec_of(plan, bf16);
    spec.d = spec.m = d;
    auto const split_forward = cuda::split_programs_of(spec);  // (B·H below the SMs: B2 T16384 H16 D128)
    check_compiles(split_forward.partials, launched);
    check_compiles(split_forward.scan, launched);
    auto backward = cuda::backward_program_of(spec);  // its backward rows
    CHECK(backward.shared_bytes() <= cuda::shared_memory_budget);
    check_compiles(backward, launched);
    for (auto const& p : cuda::split_backward_programs_of(spec)) check_compiles(p, launched);  // (B·H below the SMs)
    spec.chained = spec.step = true;  // its decode steps
    check_compiles(cuda::program_of(spec), launched);
    // The schedules its --tiles sweep takes by default (64x64p, 32x64, 64x128, 32x128, 32x128p, 16x128,
    // 64x128/512, 64x64s4, 64x64s16, 32x128s8), and the backward's other chunks, prefetching or not, of
    // 256 or 512 threads; split into groups of rows (sG: the forward's two launches, the backward's three).
    spec.chained = spec.step = false;
    for (cuda::tile_request t : {cuda::tile_request{64, 64, true}, {32, 64}, {64, 128}, {32, 128}, {32, 128, true}, {16, 128},
                                 {64, 128, false, 512}, {64, 64, false, 0, 4}, {32, 128, false, 0, 8}, {16, 0}, {0, 0, true},
                                 {0, 0, false, 512}, {32, 0, false, 0, 8}}) {
      spec.tiles = t;
      CAPTURE(t.chunk);
      CAPTURE(t.tile_m);
      CAPTURE(t.prefetch);
      CAPTURE(t.threads);
      CAPTURE(t.groups);
      check_compiles(cuda::program_of(spec));
      if (t.groups > 0) {
        auto const split = cuda::split_programs_of(spec);
        check_compiles(split.partials);
        check_compiles(split.scan);
      }
      if (t.tile_m == 0) check_compiles(cuda::backward_program_of(spec));
      if (t.tile_m == 0 && t.groups > 0)
        for (auto const& p : cuda::split_backward_programs_of(spec)) check_compiles(p);
    }
  }
}

namespace {
// The instructions tiles.cuh writes inline (its asm statements: mma.sync,
// ldmatrix, conversions, ex2, prefetch), by name: the first word of each
// statement, declarations (.reg) left out.
std::set<std::string> inline_ptx_instructions(std::string_view header) {
  static std::regex const statement_text(R"re(asm\s*(?:volatile\s*)?\(\s*"([^"]*)")re");
  std::set<std::string> names;
  std::string const text(header);
  for (auto m = std::sregex_iterator(text.begin(), text.end(), statement_text); m != std::sregex_iterator(); ++m) {
    std::string body = (*m)[1];
    for (char& c : body)
      if (c == '{' || c == '}') c = ' ';
    std::stringstream statements(body);
    for (std::string statement; std::getline(statements, statement, ';');) {
      std::stringstream words(statement);
      std::string first;
      if (words >> first && first != ".reg") names.insert(first);
    }
  }
  return names;
}
}  // namespace

// check_compiles takes every kernel to PTX for sm_80 and sm_90; the
// assembler's runs are here: kernels that together write every instruction of
// the tile vocabulary's inline PTX (checked on their PTX, so an instruction
// added to tiles.cuh that none of them writes fails this test) compile to
// sm_80 and sm_90 cubins with an empty log.
TEST_CASE("every inline PTX instruction of the tile vocabulary assembles for sm_80 and sm_90") {
  std::set<std::string> const wanted = inline_ptx_instructions(cuda::tiles_header());
  CAPTURE(wanted.size());
  REQUIRE(wanted.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 1);  // (the parser finds them)
  REQUIRE(wanted.count("cvta.to.shared.u64") == 1);
  std::vector<cuda::program> programs;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    cuda::attention_spec s;
    s.map_q = s.map_k = cuda::feature_map::elu_plus_one;
    s.d = s.m = 64;
    s.in = s.out = dt;
    programs.push_back(cuda::program_of(s));
    programs.push_back(cuda::backward_program_of(s));
    s.tiles = {64, 64, true};  // prefetching
    programs.push_back(cuda::program_of(s));
    s.tiles = {};
    s.softmax = true, s.scale = 0.125, s.map_q = s.map_k = cuda::feature_map::identity;
    programs.push_back(cuda::program_of(s));
  }
  std::string ptx;
  for (cuda::program const& p : programs) {
    CAPTURE(p.kernel_name);
    std::string const src = cuda::emit(p);
    cuda::compiled_kernel const text = check_compile(src, p.kernel_name, "compute_80", {"--Ofast-compile=max"});
    ptx.append(text.image.begin(), text.image.end());
    for (char const* arch : {"sm_80", "sm_90"}) check_compile(src, p.kernel_name, arch, {"--Ofast-compile=max"});
  }
  for (std::string const& instruction : wanted) {
    CAPTURE(instruction);
    CHECK(ptx.find(instruction) != std::string::npos);
  }
}

TEST_CASE("NVRTC errors name the call and the kernel and carry the log") {
  std::string bad = "extern \"C\" __global__ void broken_kernel() { this is not CUDA; }\n";
  try {
    cuda::compile(bad, "broken_kernel", "sm_90");
    FAIL("compiled a broken kernel");
  } catch (cuda::nvrtc_error const& e) {
    CHECK(e.call() == "nvrtcCompileProgram");
    CHECK(e.kernel() == "broken_kernel");
    CHECK(!e.log().empty());
    CHECK(std::string(e.what()).find("broken_kernel") != std::string::npos);
  }
  CHECK_THROWS_AS(cuda::compile("", "k", "gfx90a"), cuda::nvrtc_error);
  MESSAGE("NVRTC " << cuda::nvrtc_version());
}




// Where a GPU exists, generated kernels launched on it agree with their
// emulation; elsewhere the test says it is skipped.
// The kernel that adds the gradients of an input two stacked layers share on
// a device (add_program): emulated, it is the sum rounded to the element type,
// and it compiles.
TEST_CASE("add_program: out += x, rounded to the element type") {
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    std::size_t const b = 2, h = 3, n = 150, cols = 40;
    auto x = rounded(tensor<float>::random({b, h, n, cols}, 76), dt), y = rounded(tensor<float>::random({b, h, n, cols}, 77), dt);
    auto const p = cuda::add_program(dt, cols);
    std::vector<std::uint16_t> xs = bits_of(x, dt), ys = bits_of(y, dt);
    bool const wide = dt == cuda::dtype::f32;
    cuda::forward_args a;
    a.in[0] = cuda::detail::dense_operand(wide ? static_cast<void const*>(x.data()) : xs.data(), x.shape());
    a.out = cuda::detail::dense_operand(wide ? static_cast<void*>(y.data()) : ys.data(), y.shape());
    a.batch = b, a.heads = h, a.n = n;
    auto const want = y;
    cuda::emulate(p, a);
    tensor<float> const got = wide ? y : widened_from(ys, dt, {b, h, n, cols});
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      float const sum = x.data()[i] + want.data()[i];
      worst = std::max(worst, std::abs(double(got.data()[i]) - double(wide ? sum : cuda::from_bf16_bits(cuda::bf16_bits(sum)))));
    }
    CHECK(worst == 0.0);
    check_compiles(p);
  }
}

TEST_CASE("device: launched kernels agree with the emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  MESSAGE("device " << dev.device << ": " << dev.arch);
  constexpr auto causal_plan = compile<order::linear>(causal_expr);
  for_each_launch_case([](auto const& plan, cuda::dtype dt, shape s, std::uint64_t seed) { launch_vs_emulation(plan, dt, s, seed); });
  // Outputs the stores write 16 bytes at a time only in part: odd M (rows of 26 bytes in 16-bit
  // types: aligned every eighth row) and [B,N,H,M] (rows H·M apart), element by element elsewhere.
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16}) {
    launch_vs_emulation(causal_plan, dt, shape{1, 2, 77, 24, 13}, 800);
    std::size_t const b = 2, h = 3, n = 90, d = 16, m = 24;
    auto q = rounded(tensor<float>::random({b, h, n, d}, 801), dt), k = rounded(tensor<float>::random({b, h, n, d}, 802), dt),
         v = rounded(tensor<float>::random({b, h, n, m}, 803), dt);
    auto want = cuda::emulate(causal_plan, {dt, dt}, Q = q, K = k, V = v);
    auto dq = upload(q, dt), dk = upload(k, dt), dv = upload(v, dt);
    cuda::device_buffer out(want.size() * cuda::size_of(dt));
    auto go = [&]<class E>() {
      shape4 const sq{b, h, n, d}, sv{b, h, n, m};
      cuda::evaluate_into(causal_plan, cuda::device_view<E>(static_cast<E*>(out.get()), sv, {n * h * m, m, h * m, 1}), nullptr,
                          Q = cuda::device_view<E const>(static_cast<E const*>(dq.get()), sq),
                          K = cuda::device_view<E const>(static_cast<E const*>(dk.get()), sq),
                          V = cuda::device_view<E const>(static_cast<E const*>(dv.get()), sv));
    };
    if (dt == cuda::dtype::f32) go.template operator()<float>();
    if (dt == cuda::dtype::bf16) go.template operator()<cuda::bf16>();
    cuda::synchronize();
    tensor<float> const bnhm = widened_from(out, dt, {b, n, h, m});
    tensor<float> got({b, h, n, m});
    for (std::size_t x = 0; x < b; ++x)
      for (std::size_t y = 0; y < h; ++y)
        for (std::size_t r = 0; r < n; ++r)
          for (std::size_t c = 0; c < m; ++c) got.data()[((x * h + y) * n + r) * m + c] = bnhm.data()[((x * n + r) * h + y) * m + c];
    CHECK(relative_rms(got, want) <= forward_tolerance(dt));
  }
  // Grouped-query attention through views: K and V with a zero head stride (test_cuda_forward.cpp).
  {
    std::size_t const b = 2, hkv = 2, g = 3, n = 70, d = 16, m = 12;
    auto q = tensor<float>::random({b, hkv * g, n, d}, 901), k = tensor<float>::random({b, hkv, n, d}, 902),
         v = tensor<float>::random({b, hkv, n, m}, 903);
    auto dq = cuda::to_device(q), dk = cuda::to_device(k), dv = cuda::to_device(v);
    auto const gq = test::grouped_heads(q, g, false), gk = test::grouped_heads(k, g, true), gv = test::grouped_heads(v, g, true);
    auto want = cuda::emulate(causal_plan, Q = gq, K = gk, V = gv);
    auto got = cuda::evaluate(causal_plan, nullptr, Q = cuda::device_view<float const>(dq.data(), gq.shape(), gq.strides()),
                              K = cuda::device_view<float const>(dk.data(), gk.shape(), gk.strides()),
                              V = cuda::device_view<float const>(dv.data(), gv.shape(), gv.strides()));
    CHECK(relative_rms(cuda::to_host(got), want) <= 1e-6);
  }
  // poly2 past a block's state (C = 2080): quadratic, through its kernel (q·k)².
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16})
    launch_vs_emulation(compile<order::linear>(normalize(causal(phi<poly2>(Q) * transpose(phi<poly2>(K)))) * V), dt,
                        shape{1, 2, 130, 64, 16}, 700);
  // Stacked layers: one launch per layer, the intermediate in device memory.
  {
    constexpr auto stack = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K2)))) * V2);
    auto t = [](std::size_t cols, std::uint64_t seed) { return tensor<float>::random({2, 2, 150, cols}, seed); };
    auto q = t(16, 1), k = t(16, 2), v = t(16, 3), k2 = t(16, 4), v2 = t(24, 5);
    auto want = cuda::emulate(stack, Q = q, K = k, Vd = v, K2 = k2, V2 = v2);
    auto got = cuda::evaluate(stack, nullptr, Q = cuda::to_device(q), K = cuda::to_device(k), Vd = cuda::to_device(v),
                              K2 = cuda::to_device(k2), V2 = cuda::to_device(v2));
    CHECK(relative_rms(cuda::to_host(got), want) <= 1e-6);
    // Its gradient with K in both layers: the two layers' shares added on the device (add_program).
    constexpr auto shared = compile(normalize(causal(phi<elu_plus_one>(layer1) * transpose(phi<elu_plus_one>(K)))) * V2);
    auto dout = t(24, 6);
    auto g_want = cuda::emulate_gradient(shared, {}, dout, Q = q, K = k, Vd = v, V2 = v2);
    auto g = cuda::gradient(shared, cuda::to_device(dout), nullptr, Q = cuda::to_device(q), K = cuda::to_device(k),
                            Vd = cuda::to_device(v), V2 = cuda::to_device(v2));
    CHECK(relative_rms(cuda::to_host(g[K]), g_want[K]) <= 1e-5);
    CHECK(relative_rms(cuda::to_host(g[Q]), g_want[Q]) <= 1e-5);
  }
  // Cross-attention: K and V over 130 rows, Q over 70 (n_keys).
  for (auto const& cross : {compile<order::linear>(normalize(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Kx))) * Vx)}) {
    auto q = tensor<float>::random({1, 2, 70, 16}, 7), k = tensor<float>::random({1, 2, 130, 16}, 8),
         v = tensor<float>::random({1, 2, 130, 24}, 9);
    auto want = cuda::emulate(cross, Q = q, Kx = k, Vx = v);
    auto dq = cuda::to_device(q), dk = cuda::to_device(k), dv = cuda::to_device(v);
    CHECK(relative_rms(cuda::to_host(cuda::evaluate(cross, nullptr, Q = dq, Kx = dk, Vx = dv)), want) <= 1e-6);
    auto dout = tensor<float>::random({1, 2, 70, 24}, 10);
    auto g = cuda::gradient(cross, cuda::to_device(dout), nullptr, Q = dq, Kx = dk, Vx = dv);
    auto g_want = cuda::emulate_gradient(cross, {}, dout, Q = q, Kx = k, Vx = v);
    CHECK(relative_rms(cuda::to_host(g[Kx]), g_want[Kx]) <= 1e-6);
  }
  // Host memory where device memory is needed: refused before any launch.
  tensor<float> q({1, 1, 4, 8}), v({1, 1, 4, 8});
  cuda::device_buffer dout(q.size() * 4);
  cuda::device_view<float const> hq(q.data(), q.shape()), hv(v.data(), v.shape());
  CHECK_THROWS_AS(cuda::evaluate_into(causal_plan, cuda::device_view<float>(static_cast<float*>(dout.get()), v.shape()),
                                      nullptr, Q = hq, K = hq, V = hv),
                  std::invalid_argument);
}

// A few small launches, one per kind of product (fma, tf32 and bf16 tensor
// cores; causal and not): what scripts/gpu-check runs under racecheck, whose
// shared-memory tracking is too slow for the whole device suite.
TEST_CASE("device: small launches (racecheck)") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    launch_vs_emulation(compile<order::linear>(causal_expr), dt, shape{1, 1, 100, 24, 40}, 500);
    launch_vs_emulation(compile<order::linear>(full_expr), dt, shape{1, 1, 70, 16, 12}, 600);
    launch_vs_emulation(compile<order::linear>(causal(Q * transpose(K), decay{0.97}) * V), dt, shape{1, 1, 100, 24, 40}, 650);
    launch_vs_emulation(compile(normalize(causal(exp(Q * transpose(K) * 0.125), decay{0.9})) * V), dt,
                        shape{1, 1, 100, 24, 40}, 660);
  }
}

// The causal chained program cut after each instruction of its pass (but the
// store), with a store of the register that instruction wrote: what the device
// test below launches, one program per instruction.
std::vector<cuda::program> cut_programs(cuda::program const& base) {
  std::vector<cuda::program> r;
  auto const& pass = base.passes.at(0);
  for (std::size_t cut = 0; cut < pass.size(); ++cut) {
    if (pass[cut].op == cuda::opcode::store) continue;
    cuda::program p = base;
    p.passes[0].resize(cut + 1);
    p.passes[0].push_back({.op = cuda::opcode::store, .dst = pass[cut].dst, .width = 64, .by_m_tile = true});
    p.kernel_name += "_cut" + std::to_string(cut) + "_" + std::string(cuda::name_of(pass[cut].op));
    r.push_back(std::move(p));
  }
  return r;
}

// The chained causal program the per-instruction device test cuts: the plain
// mask's, or decayed by g (retention's decay_rows and weighed masks).
cuda::program cut_base(cuda::dtype dt, std::size_t d, std::size_t m, double g) {
  cuda::attention_spec s = cuda::spec_of(compile<order::linear>(causal_expr), {dt, dt});
  s.d = d, s.m = m, s.chained = true, s.decay = g;
  return cuda::program_of(s);
}

// Without a device: the cut programs emit, compile for sm_80/sm_90 with an
// empty log, and the last one (everything but the store) emulates to the
// whole program's result.
TEST_CASE("cut programs (the per-instruction device test's) compile, and the last one is the whole program") {
  for (double g : {1.0, 0.9})
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    CAPTURE(cuda::name_of(dt));
    CAPTURE(g);
    cuda::program const base = cut_base(dt, 64, 64, g);
    auto cuts = cut_programs(base);
    REQUIRE(cuts.size() + 1 == base.passes[0].size());
    for (auto const& p : cuts) check_compiles(p);
    CHECK(cuts.back().passes[0] == base.passes[0]);  // row_divide o, then store o (64 columns): the program itself
  }
}

// Each tile instruction's CUDA side against its host side: the causal chained
// program cut after one instruction, with a store of the register it wrote,
// launched and emulated on the same inputs and state (output and final state
// compared). A cut after an instruction agrees only if it and everything
// before it agree, so the first failing cut names the instruction.
TEST_CASE("device: each tile instruction = its emulation (the program cut after it)") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  std::size_t const b = 1, h = 2, n = 150, d = 64, m = 64;  // every register has ≥ 64 columns: a store of 64 fits
  for (double g : {1.0, 0.9})
  for (auto dt : {cuda::dtype::f32, cuda::dtype::bf16, cuda::dtype::f16}) {
    CAPTURE(g);
    cuda::program const base = cut_base(dt, d, m, g);
    auto q = rounded(tensor<float>::random({b, h, n, d}, 700), dt), k = rounded(tensor<float>::random({b, h, n, d}, 701), dt);
    auto v = rounded(tensor<float>::random({b, h, n, m}, 702), dt);
    auto s0 = tensor<float>::random({b, h, d, m + 1}, 703);
    for (std::size_t i = 0; i < s0.size(); ++i) s0.data()[i] = std::abs(s0.data()[i]);  // sums of elu+1 features are ≥ 0
    auto dq = upload(q, dt), dk = upload(k, dt), dv = upload(v, dt), ds0 = upload(s0, cuda::dtype::f32);
    std::size_t const out_bytes = b * h * n * m * cuda::size_of(dt), state_bytes = s0.size() * 4;
    cuda::device_buffer dout(out_bytes), ds1(state_bytes);
    auto operand_of = [](void const* data, std::size_t rows, std::size_t cols) {
      cuda::operand o;
      o.data = data;
      o.stride[0] = static_cast<std::int64_t>(h * rows * cols), o.stride[1] = static_cast<std::int64_t>(rows * cols);
      o.stride[2] = static_cast<std::int64_t>(cols), o.stride[3] = 1;
      o.cols = static_cast<std::int64_t>(cols);
      return o;
    };
    auto args = [&](void const* qp, void const* kp, void const* vp, void const* op, void const* si, void const* so) {
      cuda::forward_args a;
      a.in[0] = operand_of(qp, n, d), a.in[1] = operand_of(kp, n, d), a.in[2] = operand_of(vp, n, m);
      a.out = operand_of(op, n, m);
      a.state_in = operand_of(si, d, m + 1), a.state_out = operand_of(so, d, m + 1);
      a.batch = b, a.heads = h, a.n = n;
      return a;
    };
    for (cuda::program const& p : cut_programs(base)) {
      CAPTURE(cuda::name_of(dt));
      CAPTURE(p.kernel_name);
      // The emulation, on host copies in the kernel's element type.
      std::vector<std::uint16_t> hq = bits_of(q, dt), hk = bits_of(k, dt), hv = bits_of(v, dt);
      std::vector<std::uint16_t> hout16(b * h * n * m);
      tensor<float> hout32({b, h, n, m}), hs1({b, h, d, m + 1});
      bool const wide = dt == cuda::dtype::f32;
      void* hout = wide ? static_cast<void*>(hout32.data()) : static_cast<void*>(hout16.data());
      cuda::emulate(p, wide ? args(q.data(), k.data(), v.data(), hout, s0.data(), hs1.data())
                            : args(hq.data(), hk.data(), hv.data(), hout, s0.data(), hs1.data()));
      cuda::launch(p, args(dq.get(), dk.get(), dv.get(), dout.get(), ds0.get(), ds1.get()));
      cuda::synchronize(p.kernel_name);
      tensor<float> const want = wide ? hout32 : widened_from(hout16, dt, {b, h, n, m});
      tensor<float> const got = widened_from(dout, dt, {b, h, n, m});
      tensor<float> const got_state = widened_from(ds1, cuda::dtype::f32, {b, h, d, m + 1});
      double const bound = wide ? 1e-6 : tolerance(dt) / 4;  // as the whole-kernel launches
      CHECK(relative_rms(got, want) <= bound);
      CHECK(relative_rms(got_state, hs1) <= 1e-6);
    }
  }
}

// Without a GPU every entry point that needs one throws cuda_error saying "no
// CUDA device" and naming the call; nothing else is reachable here. (Where a
// device exists the device tests below run instead.)
TEST_CASE("no device: device tensors, copies, evaluate and chained launches throw cuda_error naming the call") {
  if (cuda::probe_device().available) {
    MESSAGE("not applicable: a CUDA device is present (the device tests run instead)");
    return;
  }
  constexpr auto plan = compile(normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V);
  auto expect = [](auto f, std::string const& call) {
    CAPTURE(call);
    try {
      f();
      FAIL("no cuda_error");
    } catch (cuda::cuda_error const& e) {
      CHECK(e.call() == call);
      CHECK(std::string(e.what()).find(call) != std::string::npos);
      CHECK(std::string(e.what()).find("no CUDA device") != std::string::npos);
    }
  };
  auto q = tensor<float>::random({1, 2, 10, 4}, 1), v = tensor<float>::random({1, 2, 10, 3}, 2);
  expect([&] { cuda::tensor<float> t({1, 2, 10, 4}); }, "cuda::tensor");
  expect([&] { cuda::tensor<cuda::bf16> t({1, 1, 1, 1}); }, "cuda::tensor");
  CHECK_NOTHROW(cuda::tensor<float>({1, 2, 0, 4}));  // nothing to allocate
  expect([&] { (void)cuda::to_device(q); }, "cuda::to_device");
  try {
    (void)cuda::to_device(q);
  } catch (cuda::cuda_error const& e) {
    MESSAGE("what a caller sees: " << std::string(e.what()));
  }
  expect([&] { (void)cuda::to_device<cuda::bf16>(q.view()); }, "cuda::to_device");
  cuda::tensor<float> empty;
  expect([&] { (void)cuda::to_host(empty); }, "cuda::to_host");

  shape4 sq{1, 2, 10, 4}, sv{1, 2, 10, 3};
  // never read: nothing is launched (the output's memory of its own: one an
  // input may share is refused first, whatever the device)
  std::vector<float> fake(80), fake_out(80);
  cuda::device_view<float const> dq(fake.data(), sq), dv(fake.data(), sv);
  cuda::device_view<float> dout(fake_out.data(), sv);
  expect([&] { (void)cuda::evaluate(plan, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate");
  expect([&] { (void)cuda::evaluate<cuda::bf16>(plan, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate");
  expect([&] { cuda::evaluate_into(plan, dout, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate_into");
  cuda::state st(plan, 1, 2);
  expect([&] { cuda::evaluate_into(plan, dout, st, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate_into");
  CHECK(!st.sized());  // the failed first use left the state as it was
  expect([&] { (void)cuda::evaluate(plan, st, nullptr, Q = dq, K = dq, V = dv); }, "cuda::evaluate");
  // States: to the device needs one; a host copy of a host state does not.
  cuda::state host(plan, 1, 2, cuda::memory::host);
  cuda::emulate(plan, {}, host, Q = q, K = q, V = v);
  expect([&] { (void)cuda::to_device(host); }, "cuda::to_device");
  expect([&] { (void)cuda::to_host(st); }, "cuda::to_host");
  cuda::state copy = cuda::to_host(host);
  CHECK(copy.where() == cuda::memory::host);
  CHECK(copy.shape() == host.shape());
  CHECK(std::equal(host.data(), host.data() + host.size(), copy.data()));
  // Decoding: a prompt and a step on the device (one token: [1, 2, 1, ·]).
  auto rnn = cuda::recurrent(plan, 1, 2);
  cuda::device_view<float const> tq(fake.data(), {1, 2, 1, 4}), tv(fake.data(), {1, 2, 1, 3});
  cuda::device_view<float> tout(fake_out.data(), {1, 2, 1, 3});
  expect([&] { rnn.step_into(tout, nullptr, Q = tq, K = tq, V = tv); }, "cuda::recurrent::step_into");
  expect([&] { rnn.prefill_into(dout, nullptr, Q = dq, K = dq, V = dv); }, "cuda::recurrent::prefill_into");
  CHECK(!rnn.state().sized());
  // The kernel launcher itself says so too, and a kernel cannot be prepared.
  cuda::forward_args a;
  expect([&] { cuda::launch(cuda::program_of(plan, {}, D = 4, M = 3), a); }, "launch");
  expect([&] { cuda::prepared_kernel k(cuda::program_of(plan, {}, D = 4, M = 3)); }, "cuda::prepared_kernel");
}

namespace {
// A float tensor as a device tensor of element type E (rounded to it).
template <class E>
cuda::tensor<E> device_copy(tensor<float> const& x) {
  return cuda::to_device<E>(x);
}
}  // namespace

TEST_CASE("device: to_device / to_host round trip, evaluate = CPU backend, chained launches = emulation") {
  auto dev = cuda::probe_device();
  if (skipped_without(dev)) return;
  constexpr auto expr = normalize(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(K)))) * V;
  constexpr auto plan = compile(expr);
  // Round trips: fp32 exactly, 16-bit types as rounded on the host.
  auto x = tensor<float>::random({2, 3, 37, 5}, 7);
  CHECK(max_abs_diff(cuda::to_host(cuda::to_device(x)), x) == 0.0);
  CHECK(max_abs_diff(cuda::to_host(cuda::to_device<cuda::bf16>(x)), rounded(x, cuda::dtype::bf16)) == 0.0);
  CHECK(max_abs_diff(cuda::to_host(cuda::to_device<cuda::f16>(x)), rounded(x, cuda::dtype::f16)) == 0.0);
  {  // a strided host view comes back dense, with the same values
    auto t = tensor<float>::like(tensor_view<float const>(x.data(), {2, 5, 37, 3}, {555, 1, 15, 5}));
    for (std::size_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(i);
    CHECK(max_abs_diff(cuda::to_host(cuda::to_device(t)), t) == 0.0);
  }
  cuda::tensor<float> moved = cuda::to_device(x);
  float const* where = moved.data();
  cuda::tensor<float> owner = std::move(moved);
  CHECK(owner.data() == where);
  CHECK(moved.data() == nullptr);

  auto run = [&]<class E>(shape s, std::uint64_t seed) {
    cuda::dtype const dt = dtype_for<E>();
    CONTEXT(cuda::name_of(dt), s.b, s.h, s.n, s.d, s.m);
    test::rng r{seed};
    auto [q, k, v] = random_inputs(s, dt, r, false);
    auto dq = device_copy<E>(q), dk = device_copy<E>(k), dv = device_copy<E>(v);
    // evaluate → a device tensor, against the CPU backend on the same inputs.
    auto got = cuda::to_host(cuda::evaluate(plan, nullptr, Q = dq, K = dk, V = dv));
    auto exact = cpu::evaluate(expr, Q = widened(q), K = widened(k), V = widened(v));
    double const bound = tolerance(dt) + rounding_bound(expr, dt, q, k, v, exact);  // the tensor cores round operands
    CHECK(relative_rms(got, exact) <= bound);
    auto wide = cuda::to_host(cuda::evaluate<float>(plan, nullptr, Q = dq, K = dk, V = dv));  // fp32 out
    // fp32 products: the same fma chains (1e-6: expf's ulps). Tensor cores sum
    // in their own order, so a score or a state element can round to the
    // neighbouring bf16 on one side and not the other (measured on an H200:
    // 1.4e-5 at N = 200, D = M = 64): the 16-bit outputs' bound.
    CHECK(relative_rms(wide, cuda::emulate(plan, {dt, cuda::dtype::f32}, Q = q, K = k, V = v)) <=
          forward_tolerance(dt));
    // Two chained launches = the chained emulation, state included.
    std::size_t at = s.n / 3 + 1;
    cuda::state st(plan, s.b, s.h), host(plan, s.b, s.h, cuda::memory::host);
    auto sub = [&](cuda::tensor<E> const& t, std::size_t from, std::size_t to) {
      return t.rows(from, to - from);
    };
    cuda::tensor<E> out({s.b, s.h, s.n, s.m});
    for (auto [from, to] : {std::pair{std::size_t{0}, at}, std::pair{at, s.n}}) {
      cuda::evaluate_into(plan, out.rows(from, to - from), st, nullptr, Q = sub(dq, from, to), K = sub(dk, from, to), V = sub(dv, from, to));
      cuda::emulate(plan, {dt, dt}, host, Q = test::tokens(q, from, to), K = test::tokens(k, from, to),
                    V = test::tokens(v, from, to));
    }
    CHECK(relative_rms(cuda::to_host(out), exact) <= bound);
    cuda::state back = cuda::to_host(st);
    tensor<float> a(back.shape()), b(host.shape());
    std::copy(back.data(), back.data() + back.size(), a.data());
    std::copy(host.data(), host.data() + host.size(), b.data());
    CHECK(relative_rms(a, b) <= 1e-6);
    // A host state continued on the device, and a device state copied on the device.
    cuda::state resumed = cuda::to_device(host);
    cuda::state twin = cuda::to_device(st);
    auto y1 = cuda::to_host(cuda::evaluate(plan, resumed, nullptr, Q = sub(dq, 0, at), K = sub(dk, 0, at), V = sub(dv, 0, at)));
    auto y2 = cuda::to_host(cuda::evaluate(plan, twin, nullptr, Q = sub(dq, 0, at), K = sub(dk, 0, at), V = sub(dv, 0, at)));
    auto y3 = cuda::emulate(plan, {dt, dt}, host, Q = test::tokens(q, 0, at), K = test::tokens(k, 0, at), V = test::tokens(v, 0, at));
    CHECK(relative_rms(y1, y3) <= tolerance(dt) / 4);
    CHECK(relative_rms(y2, y3) <= tolerance(dt) / 4);
  };
  for (shape s : {shape{2, 3, 1, 16, 8}, shape{1, 2, 200, 64, 64}, shape{1, 1, 130, 96, 200}, shape{2, 2, 150, 16, 100}}) {
    run.template operator()<float>(s, 300);
    run.template operator()<cuda::bf16>(s, 400);
  }
}

TEST_CASE("NVRTC on-disk cache: keyed by source and architecture, checked on read") {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("lina-cuda-cache-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ::setenv("LINA_CUDA_CACHE", dir.c_str(), 1);
  cuda::attention_spec s;
  s.d = 8;
  s.m = 4;
  auto p = cuda::program_of(s);
  auto src = cuda::emit(p);
  cuda::cache_counts const before = cuda::cache_statistics();
  auto first = cuda::compile_cached(src, p.kernel_name, "sm_90");
  auto again = cuda::compile_cached(src, p.kernel_name, "sm_90");
  auto other = cuda::compile_cached(src, p.kernel_name, "sm_80");
  CHECK(!first.from_cache);
  CHECK(again.from_cache);
  CHECK(!other.from_cache);
  cuda::cache_counts const after = cuda::cache_statistics();  // (what a benchmark reports)
  CHECK(after.hits - before.hits == 1);
  CHECK(after.compiled - before.compiled == 2);
  CHECK(again.image == first.image);
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 2);
  // A compile's log comes back with its image: a warning is not lost on the second read.
  std::string const warned = "extern \"C\" __global__ void warned(float* x) { int unused = 3; x[0] = 1.f; }\n";
  auto const loud = cuda::compile_cached_in(dir.string(), warned, "warned", "sm_90");
  auto const loud_again = cuda::compile_cached_in(dir.string(), warned, "warned", "sm_90");
  CHECK(loud.log.find("unused") != std::string::npos);
  CHECK(loud_again.from_cache);
  CHECK(loud_again.log == loud.log);
  CHECK(loud_again.image == loud.image);
  CHECK(loud_again.options == loud.options);
  // A damaged file is recompiled, not trusted.
  for (auto const& e : fs::directory_iterator(dir)) std::ofstream(e.path(), std::ios::binary) << "garbage";
  CHECK(!cuda::compile_cached(src, p.kernel_name, "sm_90").from_cache);
  ::setenv("LINA_CUDA_CACHE", "off", 1);
  CHECK(cuda::cache_directory().empty());
  CHECK(!cuda::compile_cached(src, p.kernel_name, "sm_90").from_cache);
  ::unsetenv("LINA_CUDA_CACHE");
  fs::remove_all(dir);
}
