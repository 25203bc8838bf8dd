// The host emulation of tile programs (see program.hpp for the semantics).
#include "lina/cuda/emulate.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "lina/cuda/numeric.hpp"

namespace lina::cuda {
namespace {

float read(void const* base, std::int64_t offset, dtype t) {
  switch (t) {
    case dtype::f32: return static_cast<float const*>(base)[offset];
    case dtype::f16: return from_f16_bits(static_cast<std::uint16_t const*>(base)[offset]);
    case dtype::bf16: return from_bf16_bits(static_cast<std::uint16_t const*>(base)[offset]);
  }
  return 0;
}
void write(void* base, std::int64_t offset, dtype t, float x) {
  switch (t) {
    case dtype::f32: static_cast<float*>(base)[offset] = x; break;
    case dtype::f16: static_cast<std::uint16_t*>(base)[offset] = f16_bits(x); break;
    case dtype::bf16: static_cast<std::uint16_t*>(base)[offset] = bf16_bits(x); break;
  }
}

// The device's formulas (tiles.cuh), in fp32; a user-defined map's host functions.
float apply(attention_spec const& s, feature_map m, float x) {
  switch (m) {
    case feature_map::identity: return x;
    case feature_map::elu_plus_one: return x > 0.0f ? x + 1.0f : std::exp(x);
    case feature_map::relu: return x < 0.0f ? 0.0f : x;  // NaN passes
    case feature_map::poly2:
    case feature_map::favor:
    case feature_map::random_fourier: break;  // row maps
    case feature_map::user0: return s.user[0].apply(x);
    case feature_map::user1: return s.user[1].apply(x);
  }
  return x;
}
// φ′(x) of an element-wise map (program.hpp, map_grad).
float derivative(attention_spec const& s, feature_map m, float x) {
  switch (m) {
    case feature_map::elu_plus_one: return x > 0.0f ? 1.0f : std::exp(x);
    case feature_map::relu: return x > 0.0f ? 1.0f : 0.0f;
    case feature_map::user0: return s.user[0].derivative(x);
    case feature_map::user1: return s.user[1].derivative(x);
    default: return 1.0f;
  }
}
// The adjoint of poly2 on one row: dx[c] = Σ_f g[f] ∂poly2(x)_f/∂x_c, one fma
// chain per dx[c] over the features in increasing order.
void poly2_adjoint(float const* x, int d, float const* g, float* dx) {
  float const r2 = 1.41421356237309504880f;
  std::fill(dx, dx + d, 0.0f);
  int f = 0;
  for (int a = 0; a < d; ++a) {
    dx[a] = std::fma(g[f++], 2.0f * x[a], dx[a]);
    for (int b = a + 1; b < d; ++b, ++f) {
      dx[a] = std::fma(g[f], r2 * x[b], dx[a]);
      dx[b] = std::fma(g[f], r2 * x[a], dx[b]);
    }
  }
}
// poly2 of one row: [x_a² (a), (√2·x_a)·x_b (b > a)], as lina::poly2 packs it.
void poly2_row(float const* x, int d, float* out) {
  float const r2 = 1.41421356237309504880f;
  int f = 0;
  for (int a = 0; a < d; ++a) {
    out[f++] = x[a] * x[a];
    for (int b = a + 1; b < d; ++b) out[f++] = r2 * x[a] * x[b];
  }
}

// x86-64 with GCC or Clang: CPU feature checks and target attributes (below).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LINA_EMULATE_X86 1
#endif

// vzeroupper where the CPU has AVX: the SSE code of the emulation then runs
// without the stalls below whatever ran before it.
void clean_upper_halves() {
#ifdef LINA_EMULATE_X86
  static bool const avx = __builtin_cpu_supports("avx");
  if (avx)
    asm volatile("vzeroupper" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#endif
}

// The products' inner loops, nearly all of the emulation's work: one row's
// chains acc[c] = fma(u[k·u_step], w[k·w_step + c], acc[c]) for k in [k0, k1),
// c in [c0, c1). Each fma is exactly rounded however it is computed, so vector
// lanes give the numbers of a scalar loop. lina::cuda is built for any x86-64,
// where std::fma is a call into libm (its FMA version: VEX code) from SSE code,
// and each switch between the two encodings stalls while the upper halves of
// the vector registers are dirty (measured: 180 ns a call instead of 3). A
// caller built with AVX at -O1 leaves them so (GCC inserts vzeroupper from -O2
// on): the CUDA test files are, and there the emulated backward tests took
// minutes each (the split backward's case over 12 minutes, 95 % in this loop;
// 0.8 s since). So where the CPU has AVX2 and FMA, a copy compiled for them
// runs (VEX code throughout, the fma in vector lanes), and emulate() starts
// from clean registers, as the SSE code after the copy does.
[[gnu::always_inline]] inline void fma_chains_as_built(float const* u, std::size_t u_step, float const* w, std::size_t w_step, float* acc,
                                                       std::size_t k0, std::size_t k1, std::size_t c0, std::size_t c1) {
  for (std::size_t k = k0; k < k1; ++k) {
    float const a = u[k * u_step];
    float const* row = w + k * w_step;
    for (std::size_t c = c0; c < c1; ++c) acc[c] = std::fma(a, row[c], acc[c]);
  }
}
#ifdef LINA_EMULATE_X86
[[gnu::target("avx2,fma")]] void fma_chains_avx2(float const* u, std::size_t u_step, float const* w, std::size_t w_step, float* acc,
                                                  std::size_t k0, std::size_t k1, std::size_t c0, std::size_t c1) {
  fma_chains_as_built(u, u_step, w, w_step, acc, k0, k1, c0, c1);
}
#endif
void fma_chains(float const* u, std::size_t u_step, float const* w, std::size_t w_step, float* acc, std::size_t k0, std::size_t k1,
                std::size_t c0, std::size_t c1) {
#ifdef LINA_EMULATE_X86
  static bool const avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) {
    fma_chains_avx2(u, u_step, w, w_step, acc, k0, k1, c0, c1);
    return clean_upper_halves();  // (a build below -O2 leaves the copy without its own vzeroupper)
  }
#endif
  fma_chains_as_built(u, u_step, w, w_step, acc, k0, k1, c0, c1);
}

struct tile {
  int rows = 0, cols = 0;
  std::vector<float> v;
  float& at(int i, int j) { return v[static_cast<std::size_t>(i) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(j)]; }
};

struct block {
  program const& p;
  forward_args const& a;
  std::int64_t b = 0, h = 0, m_tile = 0;
  std::int64_t group = 0, groups = 1, row_begin = 0, row_end = 0;  // split programs: this block's rows
  std::vector<tile> reg{};
  tile op_a{}, op_b{}, op_bt{};  // rounded (and transposed) copies of product operands
  std::vector<float> held{};      // an accumulating product's row as it was (added back after its sums)

  // Register r, or a copy of it rounded to precision p (into `copy`).
  tile const& rounded(int r, precision p, tile& copy) {
    tile const& x = reg[static_cast<std::size_t>(r)];
    if (p == precision::fma_f32) return x;
    copy.rows = x.rows, copy.cols = x.cols;
    copy.v.resize(x.v.size());
    std::transform(x.v.begin(), x.v.end(), copy.v.begin(), [p](float e) { return round_operand(p, e); });
    return copy;
  }

  // x transposed (into `copy`).
  static tile const& transposed(tile const& x, tile& copy) {
    copy.rows = x.cols, copy.cols = x.rows;
    copy.v.resize(x.v.size());
    for (int r = 0; r < x.rows; ++r)
      for (int c = 0; c < x.cols; ++c) copy.at(c, r) = x.v[static_cast<std::size_t>(r) * static_cast<std::size_t>(x.cols) + static_cast<std::size_t>(c)];
    return copy;
  }

  std::int64_t slice_offset(operand const& o) const { return b * o.stride[0] + h * o.stride[1]; }
  // A load's (or map_grad's) memory: an input, or an extra buffer past them.
  operand const& source(int slot) const { return slot < max_inputs ? a.in[slot] : a.extra[slot - max_inputs]; }
  dtype source_type(int slot) const {
    return slot < max_inputs ? p.spec.in : p.extras.at(static_cast<std::size_t>(slot - max_inputs)).type;
  }
  std::int64_t col0(instruction const& i) const { return i.by_m_tile ? m_tile * p.tiles.tile_m : 0; }
  // exp_rows' and exp_grad's score (r, c) of a chunk at r0: its query and key
  // (program.hpp), and whether it is valid.
  struct score {
    std::int64_t query, key;
  };
  score score_at(std::int64_t r0, int r, int c) const {
    return p.key_major ? score{r0 + r, row_begin + c} : score{row_begin + r, r0 + c};
  }
  bool valid(instruction const& i, score x) const { return x.query < a.n && x.key < keys_of(a) && (!i.causal || x.key <= x.query); }

  void run(instruction const& i, std::int64_t r0, int rows) {
    if (i.op == opcode::prefetch) return;  // a hint to the memory system: no register changes
    tile& t = reg[static_cast<std::size_t>(i.dst)];
    switch (i.op) {
      case opcode::zero: std::fill(t.v.begin(), t.v.end(), 0.0f); break;
      case opcode::load: {
        if (i.whole) r0 = 0, rows = t.rows;  // all of W
        operand const& o = source(i.slot);
        dtype const type = source_type(i.slot);
        std::int64_t base = slice_offset(o), c0 = col0(i);
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c) {
            bool inside = r < rows && c < i.width && c0 + c < o.cols;
            float const x = inside ? read(o.data, base + (r0 + r) * o.stride[2] + (c0 + c) * o.stride[3], type) : 0.0f;
            t.at(r, c) = i.accumulate ? t.at(r, c) + x : x;  // (accumulate: a split backward's sums)
          }
        break;
      }
      case opcode::map_grad: {
        if (parametric(i.map)) {  // in place: t = z = x·W becomes ∂z, from ∂φ (i.a) and x (i.b)
          tile& g = reg[static_cast<std::size_t>(i.a)];
          tile& x = reg[static_cast<std::size_t>(i.b)];
          int const f = t.cols;
          float const s = i.scale, inv = 1.0f / std::sqrt(static_cast<float>(f));
          for (int r = 0; r < t.rows; ++r) {
            float n = 0.0f;
            for (int c = 0; c < x.cols; ++c) n = std::fma(x.at(r, c), x.at(r, c), n);
            float const h = n * (s * s / 2.0f);
            for (int j = 0; j < f; ++j) {
              float y = 0.0f;
              if (r < rows && i.map == feature_map::favor) {
                float const phi = std::exp(std::fma(s, t.at(r, j), -h)) * inv;
                float const gp = g.at(r, j) * phi;
                y = s * gp;
              } else if (r < rows) {
                float const u = s * t.at(r, j);
                float const c = std::cos(u) * inv, sn = std::sin(u) * inv;
                float const p1 = g.at(r, f + j) * c, p0 = g.at(r, j) * sn;
                float const diff = p1 - p0;
                y = s * diff;
              }
              t.at(r, j) = y;
            }
          }
          break;
        }
        operand const& o = source(i.slot);
        dtype const type = source_type(i.slot);
        std::int64_t const base = slice_offset(o);
        std::vector<float> x(static_cast<std::size_t>(o.cols));
        if (i.a >= 0) std::fill(t.v.begin(), t.v.end(), 0.0f);
        for (int r = 0; r < rows; ++r) {
          for (std::int64_t c = 0; c < o.cols; ++c) x[static_cast<std::size_t>(c)] = read(o.data, base + (r0 + r) * o.stride[2] + c * o.stride[3], type);
          if (i.a >= 0)  // a row map, out of place: t (T × D) from the features' adjoints in a (T × C)
            poly2_adjoint(x.data(), t.cols, &reg[static_cast<std::size_t>(i.a)].at(r, 0), &t.at(r, 0));
          else
            for (int c = 0; c < t.cols; ++c) t.at(r, c) = t.at(r, c) * derivative(p.spec, i.map, x[static_cast<std::size_t>(c)]);
        }
        break;
      }
      case opcode::param_grad: {  // ∂X = ∂z·Wᵀ (− s·x·Σ∂z for favor), x read from input slot i.slot
        tile& dz = reg[static_cast<std::size_t>(i.a)];
        tile& w = reg[static_cast<std::size_t>(i.b)];
        operand const& o = source(i.slot);
        dtype const type = source_type(i.slot);
        std::int64_t const base = slice_offset(o);
        std::fill(t.v.begin(), t.v.end(), 0.0f);
        for (int r = 0; r < rows; ++r) {
          float sum = 0.0f;
          for (int f = 0; f < dz.cols; ++f) sum += dz.at(r, f);
          for (int c = 0; c < t.cols; ++c) {
            float y = 0.0f;
            for (int f = 0; f < dz.cols; ++f) y = std::fma(dz.at(r, f), w.at(c, f), y);
            if (i.map == feature_map::favor) {
              float const x = read(o.data, base + (r0 + r) * o.stride[2] + c * o.stride[3], type);
              float const sx = i.scale * x;
              y = std::fma(-sx, sum, y);
            }
            t.at(r, c) = y;
          }
        }
        break;
      }
      case opcode::rowdiv_grad: {
        tile& o = reg[static_cast<std::size_t>(i.a)];
        int const w = o.cols;
        for (int r = 0; r < rows; ++r) {
          float const d = i.b >= 0 ? std::fma(i.eps, std::exp(-reg[static_cast<std::size_t>(i.b)].at(r, 0)), o.at(r, w - 1))
                                   : o.at(r, w - 1) + i.eps;
          // 8 chains over consecutive eighths of the columns, added pairwise (tl::rowdiv_grad's lanes)
          int const eighth = (w - 1 + 7) / 8;
          float const inv = 1.0f / d;
          float part[8] = {};
          for (int c = 0; c + 1 < w; ++c) part[c / eighth] = std::fma(t.at(r, c), o.at(r, c) * inv, part[c / eighth]);
          float const sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
          t.at(r, w - 1) = -sum * inv;
          for (int c = 0; c + 1 < w; ++c) t.at(r, c) = t.at(r, c) * inv;
        }
        break;
      }
      case opcode::store_partial: {
        if (unread(i)) break;
        operand const& s = a.extra[i.slot];
        auto* data = static_cast<float*>(const_cast<void*>(s.data));
        std::int64_t base = slice_offset(s) + group * t.rows * s.stride[2], c0 = col0(i), m_cols = i.z_column ? s.cols - 1 : s.cols;
        for (int r = 0; r < t.rows; ++r) {
          for (int c = 0; c < i.width && c0 + c < m_cols; ++c) data[base + r * s.stride[2] + (c0 + c) * s.stride[3]] = t.at(r, c);
          if (i.z_column && m_tile == 0) data[base + r * s.stride[2] + (s.cols - 1) * s.stride[3]] = t.at(r, t.cols - 1);
        }
        break;
      }
      case opcode::add_partials: {
        operand const& s = a.extra[i.slot];
        auto const* data = static_cast<float const*>(s.data);
        std::int64_t const c0 = col0(i), m_cols = i.z_column ? s.cols - 1 : s.cols;
        // causal: the groups before this one (later: after it); else every group of K's rows
        std::int64_t const from = i.later ? group + 1 : 0;
        std::int64_t const side = p.extras.at(static_cast<std::size_t>(i.slot)).keys ? keys_of(a) : a.n;  // its groups' rows
        std::int64_t const upto = i.later ? groups : i.causal ? group : (side + a.group_rows - 1) / a.group_rows;
        // Decayed: Horner's rule, t = fma(t, w, sums) per group — causal in increasing g, later from the last
        // group (whose rows may be fewer) down; w = g^(its rows), as tl::decay_over builds it.
        bool const decayed = i.b >= 0;
        auto decay_over = [&](std::int64_t rows) {
          tile& pw = reg[static_cast<std::size_t>(i.b)];
          int const chunk = p.tiles.chunk;
          float x = 1.0f;
          for (std::int64_t c = 0; c < rows / chunk; ++c) x = x * pw.at(0, chunk);
          return x * pw.at(0, static_cast<int>(rows % chunk));
        };
        float const full = decayed ? decay_over(a.group_rows) : 1.0f;
        float const last = decayed ? decay_over(side - (groups - 1) * a.group_rows) : 1.0f;
        for (std::int64_t x = from; x < upto; ++x) {
          std::int64_t const g = decayed && i.later ? upto - 1 - (x - from) : x;
          float const w = g == groups - 1 ? last : full;
          std::int64_t const base = slice_offset(s) + g * t.rows * s.stride[2];
          auto add = [&](float& to, float sums) { to = decayed ? std::fma(to, w, sums) : to + sums; };
          for (int r = 0; r < t.rows; ++r)
            for (int c = 0; c < t.cols; ++c) {
              if (i.z_column && c == t.cols - 1)
                add(t.at(r, c), data[base + r * s.stride[2] + (s.cols - 1) * s.stride[3]]);
              else if (c < i.width && c0 + c < m_cols)
                add(t.at(r, c), data[base + r * s.stride[2] + (c0 + c) * s.stride[3]]);
            }
        }
        break;
      }
      case opcode::mask_anticausal:
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c)
            if (c < r)
              t.at(r, c) = 0.0f;
            else if (i.b >= 0)  // decayed: weighed by g^(c − r)
              t.at(r, c) = t.at(r, c) * reg[static_cast<std::size_t>(i.b)].at(0, c - r);
        break;
      case opcode::powers: {
        std::vector<float> const g = decay_powers(p.spec, t.cols, h);
        std::copy(g.begin(), g.end(), t.v.begin());
        break;
      }
      case opcode::decay_rows: {
        tile& g = reg[static_cast<std::size_t>(i.b)];
        int const upto = i.power == decay_power::chunk ? t.rows : rows;
        for (int r = 0; r < upto; ++r) {
          float const f = g.at(0, i.power == decay_power::row_plus_one   ? r + 1
                                  : i.power == decay_power::to_chunk_end ? rows - 1 - r
                                                                         : rows);
          for (int c = 0; c < t.cols; ++c) t.at(r, c) = t.at(r, c) * f;
        }
        break;
      }
      case opcode::map:
        if (i.b >= 0) {  // a parametric map, out of place: from x (i.a) and z = x·W (i.b)
          tile& x = reg[static_cast<std::size_t>(i.a)];
          tile& z = reg[static_cast<std::size_t>(i.b)];
          float const s = i.scale, inv = 1.0f / std::sqrt(static_cast<float>(z.cols));
          std::fill(t.v.begin(), t.v.end(), 0.0f);
          for (int r = 0; r < rows; ++r) {
            float n = 0.0f;
            for (int c = 0; c < x.cols; ++c) n = std::fma(x.at(r, c), x.at(r, c), n);
            float const h = n * (s * s / 2.0f);
            for (int j = 0; j < z.cols; ++j) {
              if (i.map == feature_map::favor) {
                t.at(r, j) = std::exp(std::fma(s, z.at(r, j), -h)) * inv;
              } else {
                float const y = s * z.at(r, j);
                t.at(r, j) = std::cos(y) * inv;
                t.at(r, z.cols + j) = std::sin(y) * inv;
              }
            }
          }
          break;
        }
        if (i.a >= 0) {  // a row map, out of place
          tile& x = reg[static_cast<std::size_t>(i.a)];
          std::fill(t.v.begin(), t.v.end(), 0.0f);
          for (int r = 0; r < rows; ++r) poly2_row(&x.at(r, 0), x.cols, &t.at(r, 0));
          break;
        }
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < t.cols; ++c) t.at(r, c) = apply(p.spec, i.map, t.at(r, c));
        break;
      case opcode::ones_column:
        for (int r = 0; r < rows; ++r) t.at(r, t.cols - 1) = 1.0f;
        break;
      case opcode::product: {
        // Per element one fma chain in increasing k, as on the device (the
        // tensor cores' order differs: only fma_f32 is bitwise); the chains of
        // a row advance together (fma_chains). Operands are rounded to the
        // product's precision first, and a transposed B is copied k-major.
        tile const& x = rounded(i.a, i.prec, op_a);
        tile const& y = i.transpose_b ? transposed(rounded(i.b, i.prec, op_b), op_bt) : rounded(i.b, i.prec, op_b);
        std::size_t const inner = static_cast<std::size_t>(i.transpose_a ? x.rows : x.cols);
        std::size_t const cols = static_cast<std::size_t>(t.cols);
        std::size_t const a_row = i.transpose_a ? 1 : inner, a_k = i.transpose_a ? static_cast<std::size_t>(x.cols) : 1;
        // A masked product's triangles (program.hpp): row r's stripe starts at s.
        auto span = [](triangle tri, std::size_t s, std::size_t n) {
          return tri == triangle::lower   ? std::pair{std::size_t{0}, std::min(s + 16, n)}
                 : tri == triangle::upper ? std::pair{std::min(s, n), n}
                                          : std::pair{std::size_t{0}, n};
        };
        // Accumulating, the chains start from zero and their sums are added to
        // t at the end (program.hpp: the state's sums in two levels).
        held.resize(cols);
        for (std::size_t r = 0; r < static_cast<std::size_t>(t.rows); ++r) {
          float* acc = t.v.data() + r * cols;
          auto const [c0, c1] = span(i.tri_t, r / 16 * 16, cols);
          auto const [k0, k1] = span(i.tri_a, r / 16 * 16, inner);
          std::fill(acc, acc + c0, 0.0f);
          std::fill(acc + c1, acc + cols, 0.0f);
          if (i.accumulate) std::copy(acc + c0, acc + c1, held.begin() + static_cast<std::ptrdiff_t>(c0));
          std::fill(acc + c0, acc + c1, 0.0f);
          fma_chains(x.v.data() + r * a_row, a_k, y.v.data(), cols, acc, k0, k1, c0, c1);
          if (i.accumulate)
            for (std::size_t c = c0; c < c1; ++c) acc[c] = held[c] + acc[c];
        }
        break;
      }
      case opcode::mask_causal:
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c)
            if (c > r)
              t.at(r, c) = 0.0f;
            else if (i.b >= 0)  // decayed: weighed by g^(r − c)
              t.at(r, c) = t.at(r, c) * reg[static_cast<std::size_t>(i.b)].at(0, r - c);
        break;
      case opcode::row_divide:
        for (int r = 0; r < t.rows; ++r) {
          float den = i.b >= 0 ? std::fma(i.eps, std::exp(-reg[static_cast<std::size_t>(i.b)].at(r, 0)), t.at(r, t.cols - 1))
                               : t.at(r, t.cols - 1) + i.eps;
          float const inv = 1.0f / den;  // one reciprocal a row (tl::row_divide)
          for (int c = 0; c + 1 < t.cols; ++c) t.at(r, c) = t.at(r, c) * inv;
        }
        break;
      case opcode::exp_rows: {
        float const ln_g = log_decay(p.spec, h);  // (0 undecayed)
        for (int r = 0; r < t.rows; ++r) {
          if (i.mask_scores)  // exp(causal(S)): a masked key's score is 0 (its weight exp(0 − shift))
            for (int c = 0; c < t.cols; ++c)
              if (score x = score_at(r0, r, c); x.key > x.query) t.at(r, c) = 0.0f;
          // Decayed, the exponent x = fma(scale, t, (query − key)·ln g) takes the score's place (as
          // tl::exp_rows<…, Decayed = true>); undecayed, the max reads scale·t and exp fuses the shift.
          auto exponent = [&](int c) {
            if (!i.decayed) return i.scale * t.at(r, c);
            score const x = score_at(r0, r, c);
            float const bias = x.query == x.key ? 0.0f : static_cast<float>(x.query - x.key) * ln_g;
            return std::fma(i.scale, t.at(r, c), bias);
          };
          float shift = 0.0f;
          if (i.b >= 0 && i.a < 0) {  // the forward's final shift
            shift = reg[static_cast<std::size_t>(i.b)].at(r, 0);
          } else if (i.b >= 0) {  // the running max
            tile& o = reg[static_cast<std::size_t>(i.a)];
            float& m = reg[static_cast<std::size_t>(i.b)].at(r, 0);
            float grown = m;
            for (int c = 0; c < t.cols; ++c)
              if (valid(i, score_at(r0, r, c))) grown = std::fmax(grown, exponent(c));  // fmax skips a NaN, as fmaxf does
            float const f = std::exp(m - grown);
            for (int c = 0; c < o.cols; ++c) o.at(r, c) = o.at(r, c) * f;
            m = shift = grown;
          }
          for (int c = 0; c < t.cols; ++c)
            t.at(r, c) = !valid(i, score_at(r0, r, c)) ? 0.0f
                         : i.decayed                   ? std::exp(exponent(c) - shift)
                                                       : std::exp(std::fma(i.scale, t.at(r, c), -shift));
        }
        break;
      }
      case opcode::prefetch: break;  // (returned above)
      case opcode::square_rows:
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c) t.at(r, c) = valid(i, score_at(r0, r, c)) ? t.at(r, c) * t.at(r, c) : 0.0f;
        break;
      case opcode::square_grad: {
        tile& e = reg[static_cast<std::size_t>(i.a)];
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c)
            t.at(r, c) = valid(i, score_at(r0, r, c)) ? 2.0f * (e.at(r, c) * t.at(r, c)) : 0.0f;
        break;
      }
      case opcode::exp_grad: {
        tile& e = reg[static_cast<std::size_t>(i.a)];
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c) {
            score const x = score_at(r0, r, c);
            bool const live = valid(i, x) && !(i.mask_scores && x.key > x.query);
            t.at(r, c) = live ? i.scale * (e.at(r, c) * t.at(r, c)) : 0.0f;
          }
        break;
      }
      case opcode::load_state: {
        operand const& s = i.slot >= 0 ? a.extra[i.slot] : a.state_in;
        auto const* data = static_cast<float const*>(s.data);
        std::int64_t base = slice_offset(s), c0 = col0(i), m_cols = i.z_column ? s.cols - 1 : s.cols;
        for (int r = 0; r < t.rows; ++r)
          for (int c = 0; c < t.cols; ++c) {
            float x = 0.0f;
            if (i.z_column && c == t.cols - 1)
              x = data[base + r * s.stride[2] + (s.cols - 1) * s.stride[3]];
            else if (c < i.width && c0 + c < m_cols)
              x = data[base + r * s.stride[2] + (c0 + c) * s.stride[3]];
            t.at(r, c) = x;
          }
        break;
      }
      case opcode::store_state: {
        if (p.split && (i.later ? group != 0 : group + 1 < groups)) break;  // the last group's sums cover every row
                                                                            // (later, a reverse walk's: the first's)
        operand const& s = a.state_out;
        auto* data = static_cast<float*>(const_cast<void*>(s.data));
        std::int64_t base = slice_offset(s), c0 = col0(i), m_cols = i.z_column ? s.cols - 1 : s.cols;
        for (int r = 0; r < t.rows; ++r) {
          for (int c = 0; c < i.width && c0 + c < m_cols; ++c) data[base + r * s.stride[2] + (c0 + c) * s.stride[3]] = t.at(r, c);
          if (i.z_column && m_tile == 0) {
            float& z = data[base + r * s.stride[2] + (s.cols - 1) * s.stride[3]];
            z = i.accumulate ? z + t.at(r, t.cols - 1) : t.at(r, t.cols - 1);
          }
        }
        break;
      }
      case opcode::store: {
        operand const& o = i.slot < 0 ? a.out : a.extra[i.slot];
        dtype const type = i.slot < 0 ? p.spec.out : p.extras.at(static_cast<std::size_t>(i.slot)).type;
        std::int64_t base = slice_offset(o), c0 = col0(i);
        void* out = const_cast<void*>(o.data);
        if (i.whole) r0 = 0, rows = t.rows;  // all of ∂W
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < i.width && c0 + c < o.cols; ++c) {
            std::int64_t const at = base + (r0 + r) * o.stride[2] + (c0 + c) * o.stride[3];
            write(out, at, type, i.accumulate ? read(out, at, type) + t.at(r, c) : t.at(r, c));
          }
        break;
      }
    }
  }

  // A bf16 register keeps what is written to it rounded to bf16 (nearest even).
  void settle(instruction const& i) {
    if (i.op == opcode::store || i.op == opcode::store_state || i.dst < 0) return;  // memory, not the register; a prefetch: nothing
    if (p.registers[static_cast<std::size_t>(i.dst)].storage != dtype::bf16) return;
    for (float& x : reg[static_cast<std::size_t>(i.dst)].v) x = from_bf16_bits(bf16_bits(x));
  }
  void step(instruction const& i, std::int64_t r0, int rows) {
    run(i, r0, rows);
    settle(i);
  }
  // Nobody reads a causal group's sums of the last group (a suffix's, later: of
  // the first): its store_partial does nothing, nor do its blocks at all when
  // they store nothing else (program.hpp).
  bool unread(instruction const& i) const {
    return i.op == opcode::store_partial && (i.later ? group == 0 : i.causal && group + 1 == groups);
  }
  bool idle() const {
    if (!p.split) return false;
    bool skipped = false, stores = false;
    for_each_instruction(p, [&](instruction const& i) {
      skipped = skipped || unread(i);
      stores = stores || i.op == opcode::store || i.op == opcode::store_state;
    });
    return skipped && !stores;
  }

  void run_all() {
    reg.clear();
    for (auto const& r : p.registers)
      reg.push_back({r.rows, r.cols, std::vector<float>(static_cast<std::size_t>(r.rows) * static_cast<std::size_t>(r.cols))});
    if (idle()) return;
    // A quadratic block's prologue, what runs before its passes and its
    // epilogue work on its rows (query rows; key-major: key rows), its passes
    // on the chunks of the other side those rows meet.
    int const own_rows = static_cast<int>(row_end - row_begin);
    for (auto const& i : p.prologue) p.quadratic ? step(i, row_begin, own_rows) : step(i, 0, 0);
    std::int64_t const t = p.tiles.chunk;
    for (auto const& pass : p.passes) {
      // The rows it walks: the keys (K, V), this block's rows of Q, or in a
      // quadratic program the other side's chunks (causal: up to the diagonal).
      std::int64_t first = pass.keys ? 0 : row_begin;
      std::int64_t last = pass.keys && !p.spec.causal ? keys_of(a) : row_end;
      if (p.split)  // (its group of rows)
        first = row_begin, last = row_end;
      else if (p.key_major)
        first = p.spec.causal ? row_begin : 0, last = a.n;
      else if (p.quadratic)
        first = 0, last = p.spec.causal ? row_end : keys_of(a);
      std::int64_t const chunks = (last - first + t - 1) / t;
      for (auto const& i : pass.before) p.quadratic ? step(i, row_begin, own_rows) : step(i, 0, 0);
      for (std::int64_t c = 0; c < chunks; ++c) {
        std::int64_t const r0 = first + (pass.reverse ? chunks - 1 - c : c) * t;
        int rows = static_cast<int>(std::min(t, last - r0));
        for (auto const& i : pass) step(i, r0, rows);
      }
    }
    for (auto const& i : p.epilogue) p.quadratic ? step(i, row_begin, own_rows) : step(i, a.n, 0);
  }
};

std::atomic<kernel_runner> installed_runner{nullptr};  // (set_kernel_runner)

// Packed sequences: the arguments as the blocks of sequence b see them — Q, K,
// V, the output and a backward's buffers by rows (∂K, ∂V, scratch) from its
// first row of their one batch row, W whole, n its rows — what the generated
// kernel computes from row_offsets (emit.cpp); the state, ∂W and a state's
// gradient keep batch row b.
forward_args sequence_args(program const& p, forward_args a, std::int64_t b) {
  std::int64_t const row0 = a.row_offsets[b];
  auto from_row0 = [&](operand& o, dtype t, bool sequence_rows) {
    if (o.data && sequence_rows) o.data = static_cast<char const*>(o.data) + row0 * o.stride[2] * static_cast<std::int64_t>(size_of(t));
    o.stride[0] = 0;  // every sequence is in batch row 0
  };
  for (std::size_t s = 0; s < p.inputs.size(); ++s) from_row0(a.in[s], p.spec.in, p.inputs[s].role != "w");
  from_row0(a.out, p.spec.out, true);
  for (std::size_t e = 0; e < p.extras.size(); ++e)  // (the others, ∂W and a state's gradient: batch row b)
    if (by_rows(p.extras[e])) from_row0(a.extra[e], p.extras[e].type, true);
  a.n = a.row_offsets[b + 1] - row0;
  a.row_offsets = nullptr;
  return a;
}

}  // namespace

kernel_runner set_kernel_runner(kernel_runner runner) noexcept { return installed_runner.exchange(runner); }

void emulate(program const& p, forward_args const& args) {
  if (args.batch < 0 || args.heads < 0 || args.n < 0) throw std::invalid_argument("lina::cuda::emulate: negative extent");
  check_heads(p, args);
  if ((p.spec.causal || p.spec.mask_scores) && keys_of(args) != args.n)
    throw std::invalid_argument("lina::cuda::emulate: kernel " + p.kernel_name + " is causal: K and V need as many rows as Q");
  if (args.out.data == nullptr && args.batch * args.heads * args.n > 0)
    throw std::invalid_argument("lina::cuda::emulate: no output");
  if (p.spec.chained && args.batch * args.heads > 0) {
    if (args.state_in.data == nullptr || args.state_out.data == nullptr)
      throw std::invalid_argument("lina::cuda::emulate: kernel " + p.kernel_name + " is chained and needs a state in and out");
    auto const rows = static_cast<std::int64_t>(features(p.spec.map_q, p.spec.d, p.spec.f));
    if (overlap(args.state_in, args.state_out, args.batch, args.heads, rows))
      throw std::invalid_argument("lina::cuda::emulate: the state in and the state out of kernel " + p.kernel_name +
                                  " overlap (one block may store its z before another loads it)");
  }
  if (args.batch * args.heads * args.n > 0)
    for (std::size_t e = 0; e < p.extras.size(); ++e)
      if (args.extra[e].data == nullptr && (keys_of(args) > 0 || !p.extras[e].keys))
        throw std::invalid_argument("lina::cuda::emulate: kernel " + p.kernel_name + " needs its buffer " + p.extras[e].name);
  if (args.row_offsets) {
    if (!packable(p) || args.n_keys >= 0)
      throw std::invalid_argument("lina::cuda::emulate: kernel " + p.kernel_name +
                                  " cannot run packed sequences in one launch (packable: one block per sequence)");
    for (std::int64_t b = 0; b < args.batch; ++b)
      if (args.row_offsets[b] < 0 || args.row_offsets[b] > args.row_offsets[b + 1] || args.row_offsets[b + 1] > args.n)
        throw std::invalid_argument("lina::cuda::emulate: the row offsets of packed sequences must rise from 0 to at most n");
  }
  if (p.split && args.group_rows % p.tiles.chunk != 0)
    throw std::invalid_argument("lina::cuda::emulate: kernel " + p.kernel_name + " needs rows per group that are a "
                                "positive multiple of its chunk");
  std::int64_t const blocks = blocks_of(p, args), groups = groups_of(p, args);
  clean_upper_halves();
  if (kernel_runner const run = installed_runner.load()) {
    if (blocks > 0 && (args.n > 0 || p.spec.chained)) run(p, args, blocks);  // (as device.cpp's check_launch)
    return;
  }
  forward_args sequence;  // (packed: the block's sequence's arguments)
  for (std::int64_t x = 0; x < blocks; ++x) {
    std::int64_t const tile = x / groups, slice = tile / p.m_tiles;
    if (args.row_offsets) sequence = sequence_args(p, args, slice / args.heads);
    forward_args const& a = args.row_offsets ? sequence : args;
    block blk{p, a};
    blk.groups = groups;
    blk.group = x % groups;
    blk.m_tile = tile % p.m_tiles;
    blk.b = slice / args.heads;
    blk.h = slice % args.heads;
    std::int64_t const rows_per = p.quadratic ? p.tiles.chunk : a.group_rows;  // per group
    std::int64_t const n = p.key_major ? keys_of(a) : a.n;                     // the rows blocks divide
    blk.row_begin = p.split || p.quadratic ? blk.group * rows_per : 0;
    blk.row_end = p.split || p.quadratic ? std::min(n, blk.row_begin + rows_per) : n;
    blk.run_all();
  }
}

}  // namespace lina::cuda
