// Tile programs of the forward attention plans (see program.hpp).
#include "lina/cuda/program.hpp"

#include "lina/errors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <bit>
#include <cctype>
#include <cmath>
#include <algorithm>
#include <limits>
#include <mutex>
#include <optional>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "lina/cuda/numeric.hpp"

namespace lina::cuda {

std::string_view name_of(dtype t) {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "?";
}
std::string_view name_of(feature_map m) {
  switch (m) {
    case feature_map::identity: return "id";
    case feature_map::elu_plus_one: return "elu+1";
    case feature_map::relu: return "relu";
    case feature_map::poly2: return "poly2";
    case feature_map::favor: return "favor";
    case feature_map::random_fourier: return "rff";
    case feature_map::user0: return "user0";
    case feature_map::user1: return "user1";
  }
  return "?";
}
std::size_t features(feature_map m, std::size_t d, std::size_t f) {
  switch (m) {
    case feature_map::poly2: return d * (d + 1) / 2;
    case feature_map::favor: return f;
    case feature_map::random_fourier: return 2 * f;
    default: return d;
  }
}
std::string_view name_of(opcode o) {
  switch (o) {
    case opcode::zero: return "zero";
    case opcode::load: return "load";
    case opcode::map: return "map";
    case opcode::ones_column: return "ones_column";
    case opcode::product: return "product";
    case opcode::mask_causal: return "mask_causal";
    case opcode::row_divide: return "row_divide";
    case opcode::store: return "store";
    case opcode::load_state: return "load_state";
    case opcode::store_state: return "store_state";
    case opcode::mask_anticausal: return "mask_anticausal";
    case opcode::map_grad: return "map_grad";
    case opcode::rowdiv_grad: return "rowdiv_grad";
    case opcode::store_partial: return "store_partial";
    case opcode::add_partials: return "add_partials";
    case opcode::exp_rows: return "exp_rows";
    case opcode::param_grad: return "param_grad";
    case opcode::exp_grad: return "exp_grad";
    case opcode::square_rows: return "square_rows";
    case opcode::square_grad: return "square_grad";
    case opcode::prefetch: return "prefetch";
    case opcode::powers: return "powers";
    case opcode::decay_rows: return "decay_rows";
  }
  return "?";
}
std::size_t size_of(dtype t) { return t == dtype::f32 ? 4 : 2; }
std::string_view name_of(precision p) {
  switch (p) {
    case precision::fma_f32: return "fma_f32";
    case precision::mma_tf32: return "mma_tf32";
    case precision::mma_bf16: return "mma_bf16";
  }
  return "?";
}
precision precision_for(dtype in) {
  switch (in) {
    case dtype::bf16: return precision::mma_bf16;
    case dtype::f16: return precision::mma_tf32;
    case dtype::f32: break;
  }
  return precision::fma_f32;
}
float round_operand(precision p, float x) {
  switch (p) {
    case precision::fma_f32: return x;
    case precision::mma_bf16: return from_bf16_bits(bf16_bits(x));
    case precision::mma_tf32: {
      if (std::isnan(x) || std::isinf(x)) return x;
      std::uint32_t u;
      std::memcpy(&u, &x, 4);
      u = (u + 0x1000u) & 0xffffe000u;  // nearest, ties away from zero (magnitude), as cvt.rna.tf32.f32
      std::memcpy(&x, &u, 4);
      return x;
    }
  }
  return x;
}
float log_decay(attention_spec const& s, std::int64_t head) {
  if (!decayed(s)) return 0;
  double const g = decay_of_head(s, head);
  return g > 0 ? static_cast<float>(std::log(g)) : -std::numeric_limits<float>::max();
}

std::vector<float> decay_powers(attention_spec const& s, int count, std::int64_t head) {
  std::vector<float> r(static_cast<std::size_t>(std::max(count, 0)));
  double const g = decay_of_head(s, head);
  for (int k = 0; k < count; ++k) {
    double const x = std::pow(g, k);
    // (no subnormal: a weight below fp32's smallest normal is 0 — a literal the compilers take as it is)
    r[static_cast<std::size_t>(k)] = x < std::numeric_limits<float>::min() ? 0.0f : static_cast<float>(x);
  }
  return r;
}
precision precision_of(attention_spec const& s) { return s.exact_products ? precision::fma_f32 : precision_for(s.in); }
int pitch_of(int cols, int bytes) {
  int const per16 = 16 / bytes;  // elements per 16 bytes
  int p = (cols + per16 - 1) / per16 * per16;
  return p * bytes / 4 % 8 == 4 ? p : p + per16;
}

namespace {
std::size_t aligned(std::size_t n) {
  return (n + program::register_alignment - 1) / program::register_alignment * program::register_alignment;
}
std::size_t bytes_of(tile_register const& r) {
  return static_cast<std::size_t>(r.rows) * static_cast<std::size_t>(r.pitch()) * static_cast<std::size_t>(r.bytes()) +
         program::read_slack;
}
// Threads per block: the spec's request, else 256.
int threads_of(attention_spec const& s) { return s.tiles.threads > 0 ? s.tiles.threads : 256; }
}  // namespace

std::size_t program::offset_of(int r) const {
  std::size_t n = 0;
  for (int i = 0; i < r; ++i) n = aligned(n + bytes_of(registers.at(static_cast<std::size_t>(i))));
  return n;
}
std::size_t program::shared_bytes() const {
  if (registers.empty()) return 0;
  int last = static_cast<int>(registers.size()) - 1;
  return offset_of(last) + bytes_of(registers.back());
}

namespace {

// f(list) for every instruction list of p, in the order a block runs them:
// the prologue, each pass's `before` and body, the epilogue.
template <class F>
void for_each_list(program& p, F&& f) {
  f(p.prologue);
  for (auto& pass : p.passes) {
    f(pass.before);
    f(static_cast<std::vector<instruction>&>(pass));
  }
  f(p.epilogue);
}

// Registers stored as bf16 (tile_register::storage) where that changes no
// result: in a program whose products round their operands to bf16 as they
// read them (mma_bf16), a register qualifies when such products read it and
// every other instruction naming it only writes it — zero, ones_column, a
// plain mask (zeros by position; a decayed one reads what it weighs), a product that does not accumulate, a load of
// one of the plan's inputs (bf16, so exact), a map out of place, or in place
// right after the load it maps (reading the exact values loaded). Every read
// of it then sees what the product would have rounded anyway, and it takes
// half the bytes: the chunk tiles φ(Q), φ(K), [V|1], W in a forward and a
// causal chunk's masked scores, never the state, the rows or gradients that
// products accumulate into or other instructions read.
void narrow_registers(program& p) {
  if (precision_of(p.spec) != precision::mma_bf16) return;
  std::size_t const n = p.registers.size();
  std::vector<bool> read_by_product(n, false), other_use(n, false);
  auto exact_load = [](instruction const& i) {
    return i.op == opcode::load && !i.accumulate && i.slot >= 0 && i.slot < max_inputs;
  };
  auto use = [](int r, std::vector<bool>& v) {
    if (r >= 0) v.at(static_cast<std::size_t>(r)) = true;
  };
  for_each_list(p, [&](std::vector<instruction>& list) {
    for (std::size_t x = 0; x < list.size(); ++x) {
      instruction const& i = list[x];
      if (i.op == opcode::product) {
        if (i.accumulate) use(i.dst, other_use);
        for (int r : {i.a, i.b}) use(r, i.prec == precision::mma_bf16 ? read_by_product : other_use);
        continue;
      }
      bool const writes_only =
          i.op == opcode::zero || i.op == opcode::ones_column ||
          ((i.op == opcode::mask_causal || i.op == opcode::mask_anticausal) && i.b < 0) || exact_load(i) ||
          (i.op == opcode::map && (i.a >= 0 || (x > 0 && exact_load(list[x - 1]) && list[x - 1].dst == i.dst)));
      if (!writes_only) use(i.dst, other_use);
      use(i.a, other_use);
      use(i.b, other_use);
    }
  });
  for (std::size_t r = 0; r < n; ++r)
    p.registers[r].storage = read_by_product[r] && !other_use[r] ? dtype::bf16 : dtype::f32;
}

// The products of a causal chunk that need only a triangle of 16-row tiles
// (instruction::tri_t, tri_a): one whose result a mask zeroes next computes
// only the tiles that mask keeps, and one whose first operand was last
// written by a mask in the same list skips that operand's zero tiles — at
// T = 64, 6 of 16 tiles of the scores and 6 of 16 k-tiles of the product
// that reads them.
void skip_masked_tiles(program& p) {
  auto kept_by = [](opcode o) {
    return o == opcode::mask_causal ? triangle::lower : o == opcode::mask_anticausal ? triangle::upper : triangle::none;
  };
  for_each_list(p, [&](std::vector<instruction>& list) {
    for (std::size_t x = 0; x < list.size(); ++x) {
      instruction& i = list[x];
      if (i.op != opcode::product) continue;
      if (x + 1 < list.size() && list[x + 1].dst == i.dst) i.tri_t = kept_by(list[x + 1].op);
      if (i.transpose_a) continue;
      for (std::size_t y = x; y-- > 0;)
        if (list[y].dst == i.a) {
          i.tri_a = kept_by(list[y].op);
          break;
        }
    }
  });
}

// spec.tiles.prefetch: each pass's chunk first requests the next chunk's rows
// of the inputs it loads into L2 — a prefetch per input slot and columns
// (a hint: results do not change). The kernel name says so (_pf).
void add_prefetches(program& p) {
  if (!p.spec.tiles.prefetch) return;
  bool any = false;
  for (pass& ps : p.passes) {
    std::vector<instruction> hints;
    for (instruction const& i : ps) {
      if (i.op != opcode::load || i.slot < 0 || i.slot >= max_inputs || i.whole || i.accumulate) continue;
      instruction const h{.op = opcode::prefetch, .slot = i.slot, .width = i.width, .by_m_tile = i.by_m_tile};
      if (std::find(hints.begin(), hints.end(), h) == hints.end()) hints.push_back(h);
    }
    any = any || !hints.empty();
    ps.insert(ps.begin(), hints.begin(), hints.end());
  }
  if (any) p.kernel_name += "_pf";
}

// What every layout ends with (a block of other than 256 threads says so in the kernel's name).
void finish_layout(program& p) {
  narrow_registers(p);
  skip_masked_tiles(p);
  add_prefetches(p);
  if (p.tiles.threads != 256) p.kernel_name += fmt::format("_th{}", p.tiles.threads);
}

// The ids used in kernel names: letters, digits and underscores only.
std::string_view id_of(feature_map m) {
  switch (m) {
    case feature_map::identity: return "id";
    case feature_map::elu_plus_one: return "elu1";
    case feature_map::relu: return "relu";
    case feature_map::poly2: return "poly2";
    case feature_map::favor: return "favor";
    case feature_map::random_fourier: return "rff";
    case feature_map::user0:
    case feature_map::user1: break;  // map_id
  }
  return "x";
}
// A map's part of a kernel name; a user-defined map's name, letters and digits kept.
std::string map_id(attention_spec const& s, feature_map m) {
  if (!user_defined(m)) return std::string(id_of(m));
  std::string r = "u";
  for (char c : user_of(s, m).name)
    if (std::isalnum(static_cast<unsigned char>(c))) r += c;
  return r;
}
// φ(K)'s part of a kernel name: its map, and "w2" when it reads a W of its own.
// A decayed spec's kernels say so, with the decay's exact value (its double's
// bits); a decay per head with the count and an FNV-1a hash of the values' bits.
std::string decay_id(attention_spec const& s) {
  if (per_head(s)) {
    std::uint64_t h = 0xcbf29ce484222325u;
    for (double g : s.head_decays) h = (h ^ std::bit_cast<std::uint64_t>(g)) * 0x100000001b3u;
    return fmt::format("_decay{}h{:016x}", s.head_decays.size(), h);
  }
  return decayed(s) ? fmt::format("_decay{:016x}", std::bit_cast<std::uint64_t>(s.decay)) : std::string();
}
std::string k_id_of(attention_spec const& s) {
  return fmt::format("{}{}", map_id(s, s.map_k), s.w_k_name.empty() ? "" : "w2");
}

struct builder {
  program p;
  // What every forward layout starts with: the spec, its tiles, the
  // products' precision and the blocks per (batch, head).
  void start(attention_spec const& s, tile_config tiles) {
    p.spec = s;
    p.tiles = tiles;
    prec = precision_of(s);
    p.m_tiles = static_cast<int>((s.m + static_cast<std::size_t>(tiles.tile_m) - 1) / static_cast<std::size_t>(tiles.tile_m));
  }
  int reg(std::string name, int rows, int cols, std::string comment) {  // (fp32 until narrow_registers)
    p.registers.push_back({std::move(name), rows, cols, std::move(comment)});
    return static_cast<int>(p.registers.size()) - 1;
  }

  // What feature maps need beyond their destination: x, the rows before a row
  // map (poly2, and the parametric maps' norms); z = x·W and W itself (input
  // slot 3, loaded once: load_w) for favor and random_fourier — and φ(K)'s
  // own W (slot 4) when it has one.
  int x = -1, z = -1, w = -1, wk = -1, d = 0;
  int w_slot = 3;  // W's input slot (φ(K)'s own: the next): 3 in a forward, 4 in a backward (after ∂out)
  void feature_registers(attention_spec const& s, int t) {
    d = static_cast<int>(s.d);
    bool const param = parametric(s.map_q) || parametric(s.map_k);
    if (param || s.map_q == feature_map::poly2 || s.map_k == feature_map::poly2)  // (also at D = 1: C = D)
      x = reg("x", t, d, "Q or K chunk before the row map (T, D)");
    if (!param) return;
    int const f = static_cast<int>(s.f);
    z = reg("z", t, f, "x·W (T, F)");
    bool const own_k = !s.w_k_name.empty();
    w = reg("w", d, f, s.w_name + (own_k ? ": φ(Q)'s random projections (D, F)" : ": the random projections (D, F)"));
    p.inputs.push_back({s.w_name, "w"});  // slot w_slot
    if (!own_k) return;
    wk = reg("wk", d, f, s.w_k_name + ": φ(K)'s random projections (D, F)");
    p.inputs.push_back({s.w_k_name, "w"});  // slot w_slot + 1
  }
  void load_w(std::vector<instruction>& list) const {
    for (auto [r, slot] : {std::pair{w, w_slot}, std::pair{wk, w_slot + 1}})
      if (r >= 0)
        list.push_back({.op = opcode::load, .dst = r, .slot = slot, .width = p.registers[static_cast<std::size_t>(r)].cols,
                        .whole = true});
  }
  static instruction zero(int t) { return {.op = opcode::zero, .dst = t}; }
  static instruction load(int t, int slot, int width, bool by_m = false) {
    return {.op = opcode::load, .dst = t, .slot = slot, .width = width, .by_m_tile = by_m};
  }
  static instruction map(int t, feature_map m, int from = -1) { return {.op = opcode::map, .dst = t, .a = from, .map = m}; }
  static instruction ones(int t) { return {.op = opcode::ones_column, .dst = t}; }
  // [V|1] (V when unnormalised) into v: `width` columns of V from this block's M tile (by_m) or column 0.
  void load_values(std::vector<instruction>& body, int v, int width, bool by_m) const {
    body.push_back(load(v, 2, width, by_m));
    if (p.spec.normalized) body.push_back(ones(v));
  }
  precision prec = precision::fma_f32;  // of every product
  instruction product(int t, int a, bool ta, int b, bool tb, bool acc) const {
    return {.op = opcode::product, .dst = t, .a = a, .b = b, .transpose_a = ta, .transpose_b = tb, .accumulate = acc,
            .prec = prec};
  }
  // A decayed scan's weights (attention_spec::decay): the register of the
  // decay's powers g^0 … g^T, filled once by the prologue; -1 without decay.
  int pw = -1;
  void decay_register(attention_spec const& s, int t) {
    if (!decayed(s)) return;
    pw = reg("pw", 1, t + 1,
             per_head(s) ? std::string("the decay's powers g^0 … g^T, g = the head's, fp32 (1, T+1)")
                         : fmt::format("the decay's powers g^0 … g^T, g = {}, fp32 (1, T+1)", s.decay));
    p.prologue.push_back({.op = opcode::powers, .dst = pw});
  }
  // t's rows weighed by the decay's power `power` (nothing without decay).
  void decay(std::vector<instruction>& body, int t, decay_power power) const {
    if (pw >= 0) body.push_back({.op = opcode::decay_rows, .dst = t, .b = pw, .power = power});
  }
  // The masks, decayed by pw when the scan is.
  instruction mask(int t) const { return {.op = opcode::mask_causal, .dst = t, .b = pw}; }
  instruction mask_upper(int t) const { return {.op = opcode::mask_anticausal, .dst = t, .b = pw}; }
  // t = a·op(x) + c·op(y): a chunk's own terms (a: its masked scores) and the
  // carried state's (y: the state). Without decay the state's product adds to
  // the chunk's; decayed, it comes first, its rows weighed by `power`
  // (decay_rows), and the chunk's — weighed in its mask — add to them.
  void chunk_and_state(std::vector<instruction>& body, int t, int a, int x, int c, int y, bool ty, decay_power power) const {
    if (pw < 0) {
      body.push_back(product(t, a, false, x, false, false));
      body.push_back(product(t, c, false, y, ty, true));
      return;
    }
    body.push_back(product(t, c, false, y, ty, false));
    decay(body, t, power);
    body.push_back(product(t, a, false, x, false, true));
  }
  // state += xᵀ·y over a chunk's rows; decayed, the state is first carried past
  // the chunk (g^rows) and x's rows weighed by their power `power` (x changes).
  void add_to_state(std::vector<instruction>& body, int st, int x, int y, decay_power power) const {
    decay(body, st, decay_power::chunk);
    decay(body, x, power);
    body.push_back(product(st, x, true, y, false, true));
  }
  // φ(X) into dst, from input slot `slot` (1: K, which reads its own W if it has one).
  void load_mapped(std::vector<instruction>& body, int dst, int slot, feature_map m) const {
    if (parametric(m)) {
      body.push_back(load(x, slot, d));
      body.push_back(product(z, x, false, slot == 1 && wk >= 0 ? wk : w, false, false));  // z = x·W
      // s = D^−¼ in fp32, as lina::favor and lina::random_fourier compute it
      body.push_back({.op = opcode::map, .dst = dst, .a = x, .b = z, .map = m,
                      .scale = static_cast<float>(std::pow(static_cast<double>(d), -0.25))});
    } else if (m == feature_map::poly2) {
      body.push_back(load(x, slot, d));
      body.push_back(map(dst, m, x));
    } else {
      body.push_back(load(dst, slot, d));
      if (m != feature_map::identity) body.push_back(map(dst, m));
    }
  }
  static instruction map_grad(int t, feature_map m, int slot, int from = -1) {
    return {.op = opcode::map_grad, .dst = t, .a = from, .slot = slot, .map = m};
  }
  static instruction rowdiv_grad(int t, int o, float eps) { return {.op = opcode::rowdiv_grad, .dst = t, .a = o, .eps = eps}; }
  static instruction store_to(int t, int slot, int width) {
    return {.op = opcode::store, .dst = t, .slot = slot, .width = width};
  }
  static instruction divide(int t, float eps) { return {.op = opcode::row_divide, .dst = t, .eps = eps}; }
  static instruction store(int t, int width) {
    return {.op = opcode::store, .dst = t, .width = width, .by_m_tile = true};
  }
  // ∂φ rows in dx → ∂X rows stored to `to` (-1: out, else extra[to]), via gx
  // for a row map. A parametric map reloads x and z = x·W (as the forward
  // computed them; the registers held the other operand's since), turns z
  // into ∂z, and adds xᵀ·∂z to its W's gradient dw (dwk: φ(K)'s own W's)
  // in fp32 products: a sum over every row.
  int dw = -1, dwk = -1;
  void finish_grad(std::vector<instruction>& body, int dx, int gx, int slot, feature_map mp, int to) const {
    if (parametric(mp)) {
      bool const k_side = slot == 1 && wk >= 0;
      int const wr = k_side ? wk : w, dwr = k_side ? dwk : dw;
      float const scale = static_cast<float>(std::pow(static_cast<double>(d), -0.25));
      body.push_back(load(x, slot, d));
      body.push_back(product(z, x, false, wr, false, false));  // z = x·W
      body.push_back({.op = opcode::map_grad, .dst = z, .a = dx, .b = x, .map = mp, .scale = scale});  // z ← ∂z
      body.push_back({.op = opcode::param_grad, .dst = gx, .a = z, .b = wr, .slot = slot, .map = mp, .scale = scale});
      body.push_back(store_to(gx, to, d));
      instruction acc = product(dwr, x, true, z, false, true);  // ∂W += xᵀ·∂z
      acc.prec = precision::fma_f32;
      body.push_back(acc);
    } else if (mp == feature_map::poly2) {
      body.push_back(map_grad(gx, mp, slot, dx));
      body.push_back(store_to(gx, to, d));
    } else {
      if (mp != feature_map::identity) body.push_back(map_grad(dx, mp, slot));
      body.push_back(store_to(dx, to, d));
    }
  }
  static instruction load_state(int t, int width, bool z) {
    return {.op = opcode::load_state, .dst = t, .width = width, .by_m_tile = true, .z_column = z};
  }
  static instruction store_state(int t, int width, bool z) {
    return {.op = opcode::store_state, .dst = t, .width = width, .by_m_tile = true, .z_column = z};
  }
};

}  // namespace

namespace {
// poly2's kernel: φ(q)·φ(k) = (q·k)² exactly (lina::poly2's packing: q_a²k_a²
// and 2·q_a q_b k_a k_b), so the scores of a poly2 plan on both sides need
// only Q's and K's D columns, not the C = D(D+1)/2 features. A chained or step
// spec needs the state, which has C rows: not for those.
bool kernel_trick(attention_spec const& s) {
  return !s.softmax && s.map_q == feature_map::poly2 && s.map_k == feature_map::poly2 && !s.chained && !s.step &&
         !decayed(s);  // (the quadratic program masks without decay)
}

// The quadratic program of a softmax spec (program.hpp: exp_rows): one block
// per (batch, head, M tile, chunk of query rows), the rows kept in o across
// the key chunks, rescaled as their running max grows (normalised plans). A
// poly2 spec through its kernel (kernel_trick; when its C × (M+1) state does
// not fit a block) has the same blocks, the scores of Q's and K's rows
// squared (square_rows) instead of exponentiated, no shift.
program lay_out_softmax(attention_spec const& s, tile_config tiles) {
  builder b;
  program& p = b.p;
  b.start(s, tiles);
  p.quadratic = true;
  bool const squared = kernel_trick(s);
  int const t = p.tiles.chunk, tm = p.tiles.tile_m;
  int const c = static_cast<int>(squared ? s.d : features(s.map_q, s.d, s.f));
  bool const row_map = !squared && (s.map_q == feature_map::poly2 || parametric(s.map_q));  // C features, not D
  int const w = tm + (s.normalized ? 1 : 0);
  bool const mask_scores = s.mask_scores && !s.causal;  // (after exp, causal masks those keys anyway)
  if (squared)
    p.kernel_name = fmt::format("lina_poly2_quadratic_{}_d{}_m{}_t{}_mt{}_{}_{}{}{}", s.causal ? "causal" : "full", s.d,
                                s.m, t, tm, name_of(s.in), name_of(s.out), s.normalized ? "" : "_unnormalized",
                                b.prec != precision_for(s.in) ? "_exact" : "");
  else
    p.kernel_name = fmt::format("lina_softmax_{}_{}_{}_d{}_m{}_t{}_mt{}_{}_{}{}{}{}",
                                s.causal ? "causal" : mask_scores ? "masked_scores" : "full",
                                map_id(s, s.map_q), k_id_of(s), s.d, s.m, t, tm, name_of(s.in), name_of(s.out),
                                s.normalized ? "" : "_unnormalized", decay_id(s),
                                b.prec != precision_for(s.in) ? "_exact" : "");
  p.description =
      squared ? fmt::format("{} poly2 attention through its kernel φ(q)·φ(k) = (q·k)² (quadratic: the {} features do "
                            "not fit a block), forward{}: {}",
                            s.causal ? "causal" : "non-causal", features(s.map_q, s.d), s.normalized ? "" : " (unnormalized)",
                            plan_text(s))
              : fmt::format("{} softmax attention (quadratic), forward{}: {}",
                            s.causal ? "causal" : mask_scores ? "non-causal, scores masked before exp," : "non-causal",
                            s.normalized ? "" : " (unnormalized)", plan_text(s));
  p.inputs = {{s.q_name, "q"}, {s.k_name, "k"}, {s.v_name, "v"}};
  std::string const v1 = s.normalized ? "[V|1]" : "V";
  std::string const cdim = row_map ? "C" : "D";
  std::string const fq = squared ? "Q" : "φ(Q)", fk = squared ? "K" : "φ(K)";
  feature_map const map_q = squared ? feature_map::identity : s.map_q, map_k = squared ? feature_map::identity : s.map_k;
  int const q = b.reg("q", t, c, fq + " of this block's query rows (T, " + cdim + ")");
  int const k = b.reg("k", t, c, fk + " chunk (T, " + cdim + ")");
  if (squared)
    b.d = static_cast<int>(s.d);  // (the loads' width: feature_registers sets it for the maps)
  else
    b.feature_registers(s, t);
  int const v = b.reg("v", t, w, v1 + " chunk, this block's columns (T, W)");
  int const a = b.reg("a", t, t, squared ? "the scores q·k, then (q·k)² (T, T)" : "the scores, then exp(scale·score − shift) (T, T)");
  int const o = b.reg("o", t, w, (squared ? "Σ (q·k)²·" : "Σ exp(·)·") + v1 + " over the key chunks so far (T, W)");
  int const mx = s.normalized && !squared
                     ? b.reg("mx", t, 1, "each row's shift: the largest scaled score so far, at least 0 (T, 1)")
                     : -1;
  b.load_w(p.prologue);
  b.load_mapped(p.prologue, q, 0, map_q);  // the block's query rows
  p.prologue.push_back(builder::zero(o));
  if (mx >= 0) p.prologue.push_back(builder::zero(mx));
  std::vector<instruction> keys;
  b.load_mapped(keys, k, 1, map_k);
  b.load_values(keys, v, tm, true);
  keys.push_back(b.product(a, q, false, k, true, false));  // a = φQ·φKᵀ
  if (squared)
    keys.push_back({.op = opcode::square_rows, .dst = a, .causal = s.causal});  // a = (q·k)²
  else
    keys.push_back({.op = opcode::exp_rows, .dst = a, .a = o, .b = mx, .scale = static_cast<float>(s.scale),
                    .causal = s.causal, .mask_scores = mask_scores,
                    .decayed = decayed(s)});  // a = exp(scale·a [+ (i−j)·ln g] − shift), o rescaled
  keys.push_back(b.product(o, a, false, v, false, true));  // o += a·[V|1]
  p.passes.push_back(std::move(keys));
  p.passes.back().keys = true;
  if (s.normalized) {
    instruction div = builder::divide(o, static_cast<float>(s.eps));
    div.b = mx;
    p.epilogue.push_back(div);
  }
  p.epilogue.push_back(builder::store(o, tm));
  finish_layout(p);
  return p;
}

// The linear program of a (valid) spec at these tile sizes (lay_out).
program lay_out_linear(attention_spec const& s, tile_config tiles) {
  builder b;
  program& p = b.p;
  b.start(s, tiles);
  int const t = p.tiles.chunk, tm = p.tiles.tile_m;
  int const c = static_cast<int>(features(s.map_q, s.d, s.f));
  bool const row_map = s.map_q == feature_map::poly2 || parametric(s.map_q);  // C features, not D
  int const w = tm + (s.normalized ? 1 : 0);
  p.kernel_name = fmt::format("lina_{}_{}_{}_d{}_m{}_t{}_mt{}_{}_{}{}{}{}{}", s.causal ? "causal" : "full",
                              map_id(s, s.map_q), k_id_of(s), s.d, s.m, t, tm, name_of(s.in), name_of(s.out),
                              s.normalized ? "" : "_unnormalized", s.chained ? "_state" : "", decay_id(s),
                              b.prec != precision_for(s.in) ? "_exact" : "");
  p.description = fmt::format("{} linear attention, forward{}{}: {}", s.causal ? "causal" : "non-causal",
                              s.normalized ? "" : " (unnormalized)",
                              s.chained ? ", chained (the state comes in and goes out)" : "", plan_text(s));
  p.inputs = {{s.q_name, "q"}, {s.k_name, "k"}, {s.v_name, "v"}};

  std::string const v1 = s.normalized ? "[V|1]" : "V";
  std::string const cdim = row_map ? "C" : "D";
  int const q = b.reg("q", t, c, "φ(Q) chunk (T, " + cdim + ")");
  int const k = b.reg("k", t, c, "φ(K) chunk (T, " + cdim + ")");
  b.feature_registers(s, t);
  int const v = b.reg("v", t, w, v1 + " chunk, this block's columns (T, W)");
  int const st = b.reg("state", c, w, "Σ φ(K)ᵀ" + v1 + " over the chunks so far, fp32 (" + cdim + ", W)");
  int const o = b.reg("o", t, w, "output rows (T, W)");
  b.decay_register(s, t);
  float const eps = static_cast<float>(s.eps);

  auto load_q = [&](std::vector<instruction>& body) { b.load_mapped(body, q, 0, s.map_q); };
  auto load_kv = [&](std::vector<instruction>& body) {
    b.load_mapped(body, k, 1, s.map_k);
    b.load_values(body, v, tm, true);
  };
  auto finish = [&](std::vector<instruction>& body) {
    if (s.normalized) body.push_back(builder::divide(o, eps));
    body.push_back(builder::store(o, tm));
  };

  // A chained scan starts from the caller's sums and leaves them there; else from 0.
  p.prologue.push_back(s.chained ? builder::load_state(st, tm, s.normalized) : builder::zero(st));
  b.load_w(p.prologue);
  if (s.chained) p.epilogue.push_back(builder::store_state(st, tm, s.normalized));
  if (s.causal) {
    // One pass: within a chunk the masked similarity, across chunks the state.
    // Decayed (state S before the chunk, row i of `rows`): o_i = Σ_{j≤i}
    // g^(i−j)·(φq_i·φk_j)·[v|1]_j + g^(i+1)·φq_i·S, and the state leaves as
    // g^rows·S + Σ_j g^(rows−1−j)·φk_jᵀ[v|1]_j.
    int const a = b.reg("a", t, t, "causal(φ(Q)·φ(K)ᵀ) of the chunk (T, T)");
    std::vector<instruction> body;
    load_q(body);
    load_kv(body);
    body.push_back(b.product(a, q, false, k, true, false));  // a = φQ·φKᵀ
    body.push_back(b.mask(a));                                // j ≤ i
    b.chunk_and_state(body, o, a, v, q, st, false, decay_power::row_plus_one);  // o = a·[V|1] + φQ·state
    b.add_to_state(body, st, k, v, decay_power::to_chunk_end);                   // state += φKᵀ·[V|1]
    finish(body);
    p.passes.push_back(std::move(body));
  } else {
    // Pass 1: the whole sum φKᵀ·[V|1]; pass 2: each row against it.
    std::vector<instruction> sum, rows;
    load_kv(sum);
    sum.push_back(b.product(st, k, true, v, false, true));
    load_q(rows);
    rows.push_back(b.product(o, q, false, st, false, false));
    finish(rows);
    p.passes.push_back(std::move(sum));
    p.passes.back().keys = true;  // K's and V's rows (cross-attention: not Q's)
    p.passes.push_back(std::move(rows));
  }
  finish_layout(p);
  return p;
}

// The quadratic form: softmax, or a poly2 spec through its kernel when its
// linear program does not fit a block even at the smallest tiles.
bool quadratic_form(attention_spec const& s) {
  if (s.softmax) return true;
  if (!kernel_trick(s)) return false;
  return lay_out_linear(s, {16, static_cast<int>(std::min<std::size_t>(8, s.m)), 256}).shared_bytes() > shared_memory_budget;
}

// The chunk lengths a spec's programs may take, longest first: the requested
// one alone, if any; a decoding step's 16 whatever was requested (its
// recurrent prefill keeps the request).
std::vector<int> chunks_of(attention_spec const& s) {
  if (s.step) return {16};
  if (s.tiles.chunk > 0) return {s.tiles.chunk};
  return {64, 32, 16};
}

// The program of a (valid) spec at these tile sizes; choose_tiles measures
// candidates with it, so the sizes it checks are the ones a program gets.
program lay_out(attention_spec const& s, tile_config tiles) {
  return quadratic_form(s) ? lay_out_softmax(s, tiles) : lay_out_linear(s, tiles);
}
}  // namespace

namespace {
// What every program needs of a spec's feature maps and its mask's decay.
void check_maps(attention_spec const& s) {
  if (decayed(s) && !(s.decay >= 0 && s.decay <= 1))
    throw std::invalid_argument(fmt::format("lina::cuda: a decay of {} was given; it is in [0, 1]", s.decay));
  for (std::size_t h = 0; h < s.head_decays.size(); ++h)
    if (!(s.head_decays[h] >= 0 && s.head_decays[h] <= 1))
      throw std::invalid_argument(fmt::format("lina::cuda: a decay of {} was given for head {}; it is in [0, 1]", s.head_decays[h], h));
  if (decayed(s) && !s.causal)
    throw std::invalid_argument("lina::cuda: a decay weighs a causal attention's past (causal(S, decay{g})); "
                                "non-causal attention has none");
  if (features(s.map_q, s.d, s.f) != features(s.map_k, s.d, s.f))
    throw std::invalid_argument("lina::cuda: φ(Q) and φ(K) must have as many features");
  for (feature_map m : {s.map_q, s.map_k})
    if (user_defined(m)) {
      user_map const& u = user_of(s, m);
      if (u.cuda_apply.empty() || u.cuda_derivative.empty() || !u.apply || !u.derivative)
        throw std::invalid_argument("lina::cuda: the user-defined map " + u.name +
                                    " needs its CUDA formulas (cuda_apply, cuda_derivative) and host functions");
    }
  if (!s.w_k_name.empty() && !(parametric(s.map_q) && s.map_k == s.map_q))
    throw std::invalid_argument("lina::cuda: a W of φ(K)'s own needs φ(Q) and φ(K) to be one parametric map");
}

// What lay_out_backward lays out: the whole backward, or one launch of its
// chunk-parallel form (program.hpp, split_backward_programs_of).
enum class backward_part { whole, sums, adjoint_sums, walks, weight_sums };

// The backward program of a (valid) spec at chunk T (program.hpp,
// backward_program_of). Slots: Q, K, V, ∂out in 0–3, W (and φ(K)'s own W) in
// 4 (5); extra[0] ∂K, extra[1] ∂V, extra[2] the scratch rows ĝ (normalised
// only), then ∂W (and ∂W2) for a parametric map, then ∂state (chained), then
// a split part's groups' sums ("partials", "∂ partials"; a parametric map's
// "∂W partials", "∂W2 partials"). A split part has the whole program's
// registers (drop_unused_registers trims them).
program lay_out_backward(attention_spec const& s, int t, backward_part part = backward_part::whole) {
  builder b;
  program& p = b.p;
  p.spec = s;
  p.tiles = {t, static_cast<int>(s.m), threads_of(s)};
  p.m_tiles = 1;
  b.prec = precision_of(s);
  int const d = static_cast<int>(s.d), m = static_cast<int>(s.m);
  int const c = static_cast<int>(features(s.map_q, s.d, s.f));
  bool const param = parametric(s.map_q) || parametric(s.map_k);
  bool const own_k = !s.w_k_name.empty();
  // ∂ through a row map (also at D = 1), or through x·W
  bool const row_map = s.map_q == feature_map::poly2 || s.map_k == feature_map::poly2 || param;
  int const w = m + (s.normalized ? 1 : 0);
  p.kernel_name = fmt::format("lina_{}_backward_{}_{}_d{}_m{}_t{}_{}_{}{}{}{}{}", s.causal ? "causal" : "full", map_id(s, s.map_q),
                              map_id(s, s.map_k), s.d, s.m, t, name_of(s.in), name_of(s.out),
                              s.normalized ? "" : "_unnormalized", s.chained ? "_state" : "", decay_id(s),
                              b.prec != precision_for(s.in) ? "_exact" : "");
  p.description = fmt::format("{} linear attention, backward{}{}: ∂{}, ∂{}, ∂{} of {}", s.causal ? "causal" : "non-causal",
                              s.normalized ? "" : " (unnormalized)",
                              s.chained ? ", chained (∂ of the state out comes in, ∂ of the state in goes out)" : "", s.q_name, s.k_name, s.v_name, plan_text(s));
  p.inputs = {{s.q_name, "q"}, {s.k_name, "k"}, {s.v_name, "v"}, {"∂out", "dout"}};
  p.out_name = "∂" + s.q_name;
  p.extras = {{.name = "∂" + s.k_name, .type = s.out, .comment = "the gradient of " + s.k_name, .keys = true, .sums_over_m = true},
              {"∂" + s.v_name, s.out, "the gradient of " + s.v_name, true}};
  int const scratch = max_inputs + 2;  // the load slot of extra[2]
  if (s.normalized)
    p.extras.push_back({"scratch", dtype::f32, "ĝ: the adjoint of the unnormalised rows [num | den], fp32", false, s.m + 1});
  int const dw_at = param ? static_cast<int>(p.extras.size()) : -1;  // ∂W, then φ(K)'s ∂W2
  if (param)
    p.extras.push_back({.name = "∂" + s.w_name, .type = s.out,
                        .comment = "the gradient of " + s.w_name + " per (batch, head) [B, H, D, F]", .sums_over_m = true});
  if (own_k)
    p.extras.push_back(
        {.name = "∂" + s.w_k_name, .type = s.out,
         .comment = "the gradient of " + s.w_k_name + " per (batch, head) [B, H, D, F]", .sums_over_m = true});
  int const d_final = s.chained ? static_cast<int>(p.extras.size()) : -1;  // chained: ∂(the state it leaves), read
  if (s.chained)
    p.extras.push_back({"∂state out", dtype::f32, "the gradient of the state the block leaves, fp32 [B, H, C, W] (0: the end)"});
  bool const split = part != backward_part::whole;
  int const sums_at = split ? static_cast<int>(p.extras.size()) : -1;  // the groups' Σ φ(K)ᵀ[V|1], then Σ φ(Q)ᵀĝ
  if (split) {
    p.split = true;
    for (std::string_view x : {"partials", "∂ partials"})  // (over groups of K's rows, then of Q's)
      p.extras.push_back({.name = std::string(x), .type = dtype::f32,
                          .comment = x == "partials" ? "Σ φ(K)ᵀ" + std::string(s.normalized ? "[V|1]" : "V") +
                                                           " per group of K's rows, fp32 [B, H, groups·C, W]"
                                                     : "Σ φ(Q)ᵀĝ per group of Q's rows, fp32 [B, H, groups·C, W]",
                          .keys = x == "partials",
                          .cols = static_cast<std::size_t>(m) + (s.normalized ? 1 : 0),
                          .rows = static_cast<std::size_t>(c), .per_group = true});
  }
  // Split, each group's shares of ∂W (∂W2). Causal, one launch (the walks)
  // sums both sides' terms of a group: a buffer per W. Non-causal, groups of
  // Q's rows (the adjoint sums' launch) give φ(Q)'s terms and groups of K's
  // rows (the walks) φ(K)'s: a buffer per side, φ(K)'s of K's groups (for a W
  // of its own, that is ∂W2's).
  struct w_share {
    bool w2;             // ∂W2's (a W of φ(K)'s own), else ∂W's
    int slot;
    backward_part part;  // the launch that stores it
  };
  std::vector<w_share> w_shares;
  if (split && param) {
    auto share = [&](std::string const& x, bool keys) {
      p.extras.push_back({.name = "∂" + x + " partials", .type = dtype::f32,
                          .comment = fmt::format("each group{}'s share of ∂{}, fp32 [B, H, groups·D, F]",
                                                 s.causal ? "" : keys ? " of K's rows" : " of Q's rows", x),
                          .keys = keys, .cols = static_cast<std::size_t>(s.f), .rows = static_cast<std::size_t>(d),
                          .per_group = true});
      return static_cast<int>(p.extras.size()) - 1;
    };
    if (s.causal) {
      w_shares.push_back({false, share(s.w_name, false), backward_part::walks});
      if (own_k) w_shares.push_back({true, share(s.w_k_name, false), backward_part::walks});
    } else {
      if (parametric(s.map_q)) w_shares.push_back({false, share(s.w_name, false), backward_part::adjoint_sums});
      if (parametric(s.map_k))
        w_shares.push_back({own_k, share(own_k ? s.w_k_name : s.w_name + " (K's rows)", true), backward_part::walks});
    }
  }

  std::string const v1 = s.normalized ? "[V|1]" : "V";
  std::string const cdim = row_map ? "C" : "D";
  int const q = b.reg("q", t, c, "φ(Q) chunk (T, " + cdim + ")");
  int const k = b.reg("k", t, c, "φ(K) chunk (T, " + cdim + ")");
  b.w_slot = 4;
  b.feature_registers(s, t);
  int const f = static_cast<int>(s.f);
  int const dw = b.dw = param ? b.reg("dw", d, f, "∂" + s.w_name + " = Σ xᵀ·∂z over the rows so far, fp32 (D, F)") : -1;
  int const dwk = b.dwk = own_k ? b.reg("dwk", d, f, "∂" + s.w_k_name + " = Σ kᵀ·∂z over K's rows so far, fp32 (D, F)") : -1;
  int const v = b.reg("v", t, w, v1 + " chunk (T, W)");
  int const g = b.reg("g", t, w, s.normalized ? "ĝ: ∂out, then the adjoint of the unnormalised rows (T, W)" : "∂out chunk (T, M)");
  int const o = b.reg("o", t, w, s.normalized ? "the unnormalised rows [num | den], then ∂" + v1 + " (T, W)" : "∂V rows (T, M)");
  int const a = b.reg("a", t, t, "a chunk's scores or their adjoints (T, T)");
  int const dx = b.reg("dx", t, c, "∂φ(Q) or ∂φ(K) rows (T, " + cdim + ")");
  int const gx = row_map ? b.reg("gx", t, d, "∂Q or ∂K rows through the row map or x·W (T, D)") : -1;
  int const st = b.reg("state", c, w, "S = Σ φ(K)ᵀ" + v1 + " (forward), then R = Σ φ(Q)ᵀĝ (reverse), fp32 (" + cdim + ", W)");
  b.decay_register(s, t);
  float const eps = static_cast<float>(s.eps);

  // ĝ: ∂out, through rowdiv's adjoint when normalised (o holds the rows), kept in scratch.
  auto adjoint_rows = [&](std::vector<instruction>& body) {
    body.push_back(builder::load(g, 3, m));
    if (s.normalized) {
      body.push_back(builder::rowdiv_grad(g, o, eps));
      body.push_back(builder::store_to(g, 2, w));
    }
  };
  auto reload_adjoint = [&](std::vector<instruction>& body) {
    body.push_back(s.normalized ? builder::load(g, scratch, w) : builder::load(g, 3, m));
  };

  // Chained: the forward walk starts from the block's initial state S0, the
  // reverse walk from the gradient of the state it leaves (later blocks'
  // Σ φ(q)ĝᵀ), and what the reverse walk ends with is the gradient of S0.
  // A split part's groups' sums: S ("partials") or R ("∂ partials"); causal,
  // of the groups before this block's, or after it (later: a reverse walk's
  // suffix); non-causal, of all of them.
  // Decayed, the groups' sums are added by Horner's rule (add_partials with the powers register).
  auto group_sums = [&](opcode op, bool r, bool later = false) {
    return instruction{.op = op, .dst = st, .b = op == opcode::add_partials ? b.pw : -1, .slot = sums_at + (r ? 1 : 0),
                       .width = m, .by_m_tile = true, .z_column = s.normalized, .causal = s.causal, .later = later};
  };
  // The sums S: the whole backward reads them; causal, the walks and a
  // normalised plan's adjoint sums (its rows), non-causal the adjoint sums
  // (∂Q = ĝ·Sᵀ); the groups' own sums do not.
  bool const reads_s = part == backward_part::whole ||
                       (s.causal ? part == backward_part::walks || (part == backward_part::adjoint_sums && s.normalized)
                                 : part == backward_part::adjoint_sums);
  bool const stores_d_s0 = s.chained && (part == backward_part::whole || part == backward_part::walks);
  p.prologue.push_back(s.chained && reads_s ? builder::load_state(st, m, s.normalized) : builder::zero(st));
  if (split && reads_s) p.prologue.push_back(group_sums(opcode::add_partials, false));
  if (split && !s.causal && part == backward_part::walks) p.prologue.push_back(group_sums(opcode::add_partials, true));
  if (stores_d_s0) {  // split: the first group's reverse walk ends with every row's sums
    p.epilogue.push_back(builder::store_state(st, m, s.normalized));
    p.epilogue.back().later = split;
  }
  b.load_w(p.prologue);
  // ∂W (∂W2): a sum over every row; split, the launches above store each
  // group's shares and a last one (weight_sums) adds them in a fixed order:
  // the groups', and non-causal with one W, Q's groups' before K's.
  std::vector<instruction> w_first, w_last;
  for (auto [r, at, w2] : {std::tuple{dw, dw_at, false}, std::tuple{dwk, dw_at + 1, true}}) {
    if (r < 0) continue;
    if (!split) {
      w_first.push_back(builder::zero(r));
      w_last.push_back(builder::store_to(r, at, f));
      w_last.back().whole = true;
      continue;
    }
    bool zeroed = false;
    for (w_share const& x : w_shares) {
      if (x.w2 != w2 || (part != x.part && part != backward_part::weight_sums)) continue;
      if (!zeroed) w_first.push_back(builder::zero(r)), zeroed = true;
      instruction shares{.op = opcode::add_partials, .dst = r, .slot = x.slot, .width = f, .by_m_tile = true};
      if (part == backward_part::weight_sums) {
        w_first.push_back(shares);
      } else {
        shares.op = opcode::store_partial;
        w_last.push_back(shares);
      }
    }
    if (part == backward_part::weight_sums) {
      w_last.push_back(builder::store_to(r, at, f));
      w_last.back().whole = true;
    }
  }
  if (part == backward_part::weight_sums) {  // a block per (batch, head), no rows: the groups' shares added, stored
    p.prologue = std::move(w_first);
    p.epilogue = std::move(w_last);
    p.split = false;
    finish_layout(p);
    return p;
  }
  p.prologue.insert(p.prologue.end(), w_first.begin(), w_first.end());
  p.epilogue.insert(p.epilogue.end(), w_last.begin(), w_last.end());
  std::vector<instruction> reverse_start{builder::zero(st)};
  if (s.chained) reverse_start[0] = builder::load_state(st, m, s.normalized), reverse_start[0].slot = d_final;
  if (split) reverse_start.push_back(group_sums(opcode::add_partials, true, true));
  // The rows again: o = causal(φQ·φKᵀ)·[V|1] + φQ·S (decayed as the forward weighs them).
  auto rows_again = [&](std::vector<instruction>& body) {
    body.push_back(b.product(a, q, false, k, true, false));
    body.push_back(b.mask(a));
    b.chunk_and_state(body, o, a, v, q, st, false, decay_power::row_plus_one);
  };
  if (s.causal && part == backward_part::sums) {  // the group's Σ φKᵀ·[V|1] (decayed: to its last row)
    std::vector<instruction> sum;
    b.load_mapped(sum, k, 1, s.map_k);
    b.load_values(sum, v, m, false);
    b.add_to_state(sum, st, k, v, decay_power::to_chunk_end);
    p.passes.emplace_back(std::move(sum));
    p.epilogue.push_back(group_sums(opcode::store_partial, false));
  } else if (s.causal && part == backward_part::adjoint_sums) {  // the group's Σ φQᵀ·ĝ
    if (s.normalized) {  // ĝ first: the group's rows from S, rowdiv's adjoint, kept in the scratch rows
      std::vector<instruction> rows;
      b.load_mapped(rows, q, 0, s.map_q);
      b.load_mapped(rows, k, 1, s.map_k);
      b.load_values(rows, v, m, false);
      rows_again(rows);
      adjoint_rows(rows);
      b.add_to_state(rows, st, k, v, decay_power::to_chunk_end);
      p.passes.emplace_back(std::move(rows));
    }
    // Decayed, the group's Σ g^(i+1)·φq_iᵀĝ_i (i from its first row: the gradient of the state
    // before it) is a reverse walk's, as the whole backward's.
    std::vector<instruction> adj;
    b.load_mapped(adj, q, 0, s.map_q);
    reload_adjoint(adj);
    b.add_to_state(adj, st, q, g, decay_power::row_plus_one);
    p.passes.emplace_back(std::move(adj), decayed(s),
                          s.normalized ? std::vector<instruction>{builder::zero(st)} : std::vector<instruction>{});
    p.epilogue.push_back(group_sums(opcode::store_partial, true, true));
  } else if (s.causal) {
    std::vector<instruction> fwd, rev;
    bool const kept = s.normalized && part == backward_part::walks;  // ĝ from the adjoint sums' launch
    if (!kept) b.load_mapped(fwd, q, 0, s.map_q);
    b.load_mapped(fwd, k, 1, s.map_k);
    b.load_values(fwd, v, m, false);
    if (kept) {
      reload_adjoint(fwd);
    } else {
      if (s.normalized) rows_again(fwd);
      adjoint_rows(fwd);
    }
    // Decayed, every term as the forward weighs it: ∂φq_i = Σ_{j≤i}
    // g^(i−j)·(ĝ_i·[v|1]_j)·φk_j + g^(i+1)·ĝ_i·Sᵀ, and S advances as there.
    fwd.push_back(b.product(a, g, false, v, true, false));   // a = ĝ·[V|1]ᵀ
    fwd.push_back(b.mask(a));                                 // j ≤ i
    b.chunk_and_state(fwd, dx, a, k, g, st, true, decay_power::row_plus_one);  // ∂φQ = a·φK + ĝ·Sᵀ (earlier chunks)
    b.add_to_state(fwd, st, k, v, decay_power::to_chunk_end);                   // S += φKᵀ·[V|1]
    b.finish_grad(fwd, dx, gx, 0, s.map_q, -1);

    b.load_mapped(rev, q, 0, s.map_q);
    b.load_mapped(rev, k, 1, s.map_k);
    b.load_values(rev, v, m, false);
    reload_adjoint(rev);
    // Decayed, R is the gradient of the state at the chunk's last row: row j
    // of the chunk reads it weighed by g^(rows−1−j), and it leaves as
    // g^rows·R + Σ_i g^(i+1)·φq_iᵀĝ_i — after chunk 0, the gradient of S0.
    rev.push_back(b.product(a, v, false, g, true, false));   // a[j][i] = [v|1]_j·ĝ_i
    rev.push_back(b.mask_upper(a));                           // i ≥ j
    b.chunk_and_state(rev, dx, a, q, v, st, true, decay_power::to_chunk_end);  // ∂φK = a·φQ + [V|1]·Rᵀ (later chunks)
    rev.push_back(b.product(a, k, false, q, true, false));   // a[j][i] = φk_j·φq_i
    rev.push_back(b.mask_upper(a));
    b.chunk_and_state(rev, o, a, g, k, st, false, decay_power::to_chunk_end);  // ∂[V|1] = a·ĝ + φK·R
    rev.push_back(builder::store_to(o, 1, m));
    b.add_to_state(rev, st, q, g, decay_power::row_plus_one);                   // R += φQᵀ·ĝ
    b.finish_grad(rev, dx, gx, 1, s.map_k, 0);
    p.passes.emplace_back(std::move(fwd));
    p.passes.emplace_back(std::move(rev), true, std::move(reverse_start));
  } else {
    std::vector<instruction> sum, rows, adj, kv;
    b.load_mapped(sum, k, 1, s.map_k);  // S = Σ φKᵀ·[V|1]
    b.load_values(sum, v, m, false);
    sum.push_back(b.product(st, k, true, v, false, true));
    b.load_mapped(rows, q, 0, s.map_q);  // the rows, their adjoint, ∂φQ = ĝ·Sᵀ
    if (s.normalized) rows.push_back(b.product(o, q, false, st, false, false));
    adjoint_rows(rows);
    rows.push_back(b.product(dx, g, false, st, true, false));
    b.finish_grad(rows, dx, gx, 0, s.map_q, -1);
    b.load_mapped(adj, q, 0, s.map_q);  // R = Σ φQᵀ·ĝ
    reload_adjoint(adj);
    adj.push_back(b.product(st, q, true, g, false, true));
    b.load_mapped(kv, k, 1, s.map_k);  // ∂φK = [V|1]·Rᵀ, ∂[V|1] = φK·R
    b.load_values(kv, v, m, false);
    kv.push_back(b.product(dx, v, false, st, true, false));
    kv.push_back(b.product(o, k, false, st, false, false));
    kv.push_back(builder::store_to(o, 1, m));
    b.finish_grad(kv, dx, gx, 1, s.map_k, 0);
    // Split: the sums over groups of K's rows; S from all of them, each group
    // of Q's rows its rows, ĝ, ∂Q and Σ φQᵀ·ĝ; R from all of those, each group
    // of K's rows ∂K and ∂V.
    bool const all = part == backward_part::whole;
    if (all || part == backward_part::sums) {
      p.passes.emplace_back(std::move(sum));
      p.passes.back().keys = true;
    }
    if (all || part == backward_part::adjoint_sums) {
      p.passes.emplace_back(std::move(rows));
      p.passes.emplace_back(std::move(adj), false, std::vector<instruction>{builder::zero(st)});
    }
    if (all || part == backward_part::walks) {
      p.passes.emplace_back(std::move(kv));
      p.passes.back().keys = true;
    }
    p.key_major = part == backward_part::sums || part == backward_part::walks;  // (groups of K's rows)
    if (part == backward_part::sums) p.epilogue.push_back(group_sums(opcode::store_partial, false));
    if (part == backward_part::adjoint_sums) p.epilogue.push_back(group_sums(opcode::store_partial, true));
  }
  finish_layout(p);
  return p;
}

// The buffers every program of a softmax spec's backward reads or writes,
// on one forward_args: ∂K, ∂V; normalised, the fp32 scratch ĝ and each row's
// shift m; with a parametric map, ∂φ(Q) and ∂φ(K) as scratch, then ∂W (∂W2).
std::vector<extra_buffer> softmax_backward_extras(attention_spec const& s) {
  std::size_t const c = features(s.map_q, s.d, s.f);
  std::vector<extra_buffer> e = {
      {.name = "∂" + s.k_name, .type = s.out, .comment = "the gradient of " + s.k_name, .keys = true, .sums_over_m = true},
      {"∂" + s.v_name, s.out, "the gradient of " + s.v_name, true}};
  if (s.normalized) {
    e.push_back({"scratch", dtype::f32, "ĝ: the adjoint of the shifted rows [num | den], fp32 [B, H, N, M+1]", false, s.m + 1});
    if (s.softmax)  // (poly2 through its kernel: no shift)
      e.push_back({"shift", dtype::f32, "each query row's final shift m, fp32 [B, H, N, 1]", false, 1});
  }
  if (parametric(s.map_q)) e.push_back({"∂φ(" + s.q_name + ")", dtype::f32, "∂φ(Q) rows, fp32 [B, H, N, C]", false, c});
  if (parametric(s.map_k)) e.push_back({"∂φ(" + s.k_name + ")", dtype::f32, "∂φ(K) rows, fp32 [B, H, N_keys, C]", true, c});
  if (parametric(s.map_q) || parametric(s.map_k))
    e.push_back({.name = "∂" + s.w_name, .type = s.out,
                 .comment = "the gradient of " + s.w_name + " per (batch, head) [B, H, D, F]", .sums_over_m = true});
  if (!s.w_k_name.empty())
    e.push_back({.name = "∂" + s.w_k_name, .type = s.out,
                 .comment = "the gradient of " + s.w_k_name + " per (batch, head) [B, H, D, F]", .sums_over_m = true});
  return e;
}

// The two quadratic programs of a softmax spec's backward at chunk T
// (program.hpp, backward_programs_of): key_side false, a block per chunk of
// query rows giving ∂Q (and storing ĝ and the shift m); true, key-major, a
// block per chunk of key rows giving ∂K and ∂V. Slots: Q, K, V, ∂out in 0–3,
// W (and φ(K)'s own) in 4 (5); extras: softmax_backward_extras. A parametric
// side stores ∂φ rows for lay_out_softmax_param_grad instead of its gradient.
program lay_out_softmax_backward(attention_spec const& s, int t, bool key_side) {
  builder b;
  program& p = b.p;
  b.start(s, {t, static_cast<int>(s.m), threads_of(s)});  // every column of M in one block: ∂S sums over them
  p.quadratic = true;
  p.key_major = key_side;
  bool const squared = kernel_trick(s);  // poly2 through its kernel: A = (Q·Kᵀ)², ∂S = 2·S∘∂A
  int const d = static_cast<int>(s.d), m = static_cast<int>(s.m);
  int const c = static_cast<int>(squared ? s.d : features(s.map_q, s.d, s.f));
  bool const row_map = !squared && (s.map_q == feature_map::poly2 || s.map_k == feature_map::poly2);
  bool const param = parametric(s.map_q) || parametric(s.map_k);
  feature_map const map_q = squared ? feature_map::identity : s.map_q, map_k = squared ? feature_map::identity : s.map_k;
  int const w = m + (s.normalized ? 1 : 0);
  bool const mask_scores = s.mask_scores && !s.causal;
  float const eps = static_cast<float>(s.eps), scale = static_cast<float>(s.scale);
  p.kernel_name = fmt::format("lina_{}_{}_backward_{}_{}_{}_d{}_m{}_t{}_{}_{}{}{}{}", squared ? "poly2_quadratic" : "softmax",
                              s.causal ? "causal" : mask_scores ? "masked_scores" : "full", key_side ? "kv" : "q",
                              map_id(s, s.map_q), map_id(s, s.map_k), s.d, s.m, t, name_of(s.in), name_of(s.out),
                              s.normalized ? "" : "_unnormalized", decay_id(s),
                              b.prec != precision_for(s.in) ? "_exact" : "");
  p.description = fmt::format("{} {} (quadratic), backward{}, {}: {}",
                              s.causal ? "causal" : mask_scores ? "non-causal, scores masked before exp," : "non-causal",
                              squared ? "poly2 attention through its kernel (q·k)²" : "softmax attention",
                              s.normalized ? "" : " (unnormalized)",
                              key_side ? fmt::format("∂{}, ∂{} per chunk of key rows", s.k_name, s.v_name)
                                       : fmt::format("∂{} per chunk of query rows", s.q_name),
                              plan_text(s));
  p.inputs = {{s.q_name, "q"}, {s.k_name, "k"}, {s.v_name, "v"}, {"∂out", "dout"}};
  p.out_name = "∂" + s.q_name;
  p.extras = softmax_backward_extras(s);
  int const scratch = max_inputs + 2, shift = max_inputs + 3;  // their load slots

  std::string const v1 = s.normalized ? "[V|1]" : "V";
  std::string const cdim = row_map || param ? "C" : "D";
  std::string const mine = key_side ? "this block's key rows" : "this block's query rows";
  std::string const fq = squared ? "Q " : "φ(Q) ", fk = squared ? "K " : "φ(K) ";
  int const q = b.reg("q", t, c, fq + (key_side ? std::string("chunk") : mine) + " (T, " + cdim + ")");
  int const k = b.reg("k", t, c, fk + (key_side ? mine : std::string("chunk")) + " (T, " + cdim + ")");
  b.w_slot = 4;
  if (squared)
    b.d = d;  // (the loads' width: feature_registers sets it for the maps)
  else
    b.feature_registers(s, t);
  b.load_w(p.prologue);
  int const v = b.reg("v", t, w, v1 + (key_side ? " of " + mine : std::string(" chunk")) + " (T, W)");
  int const g = b.reg("g", t, w, s.normalized ? "ĝ: the adjoint of the shifted rows [num | den] (T, W)" : "∂out rows (T, M)");
  int const a = b.reg("a", t, t, squared ? "the scores S = q·k, then A = S² (T queries × T keys)"
                                         : "the scores, then E = exp(scale·score − m) (T queries × T keys)");
  int const ds = b.reg("ds", t, t, "ĝ·" + v1 + "ᵀ, then ∂S = " + (squared ? "2·S∘" : "scale·E∘") + "(ĝ·" + v1 + "ᵀ) (T, T)");
  int const mx = s.normalized && !squared ? b.reg("mx", t, 1, "each query row's shift m (T, 1)") : -1;
  int const o = s.normalized && !key_side ? b.reg("o", t, w, "the shifted rows [num | den] again (T, W)") : -1;
  std::string const dname = squared ? (key_side ? "∂K" : "∂Q") : (key_side ? "∂φ(K)" : "∂φ(Q)");
  int const dx = b.reg(key_side ? "dk" : "dq", t, c, dname + " of " + mine + " (T, " + cdim + ")");
  int const dv = key_side ? b.reg("dv", t, w, "∂" + v1 + " of " + mine + " (T, W)") : -1;
  int const gx = row_map ? b.reg("gx", t, d, "∂Q or ∂K rows through the row map (T, D)") : -1;
  // ∂φ rows → the gradient; a parametric map's go to scratch for the third program (∂W sums over every block).
  auto finish = [&](std::vector<instruction>& list, int grad, int slot, feature_map mp, int to) {
    if (parametric(mp))
      list.push_back(builder::store_to(grad, static_cast<int>(extra_named(p, "∂φ(" + (slot == 1 ? s.k_name : s.q_name) + ")")), c));
    else
      b.finish_grad(list, grad, gx, slot, mp, to);
  };

  instruction exp_fixed{.op = opcode::exp_rows, .dst = a, .b = mx, .scale = scale, .causal = s.causal,
                        .mask_scores = mask_scores, .decayed = decayed(s)};  // a = E, with the forward's final shift
  instruction const exp_grad{.op = opcode::exp_grad, .dst = ds, .a = a, .scale = scale, .causal = s.causal,
                             .mask_scores = mask_scores};  // ds = ∂S
  instruction const square{.op = opcode::square_rows, .dst = a, .causal = s.causal};               // a = S²
  instruction const square_grad{.op = opcode::square_grad, .dst = ds, .a = a, .causal = s.causal};  // ds = 2·S∘ds
  if (!key_side) {
    b.load_mapped(p.prologue, q, 0, map_q);
    p.prologue.push_back(builder::zero(dx));
    std::vector<instruction> keys;  // ∂φQ = Σ ∂S·φK over the key chunks
    b.load_mapped(keys, k, 1, map_k);
    b.load_values(keys, v, m, false);
    keys.push_back(b.product(a, q, false, k, true, false));  // a = φQ·φKᵀ
    if (!squared) keys.push_back(exp_fixed);                   // a = E
    keys.push_back(b.product(ds, g, false, v, true, false));  // ds = ĝ·[V|1]ᵀ
    keys.push_back(squared ? square_grad : exp_grad);          // ds = ∂S
    keys.push_back(b.product(dx, ds, false, k, false, true)); // ∂φQ += ∂S·φK
    if (s.normalized) {  // first the rows again, as the forward ran them: o and the final shift m
      p.prologue.push_back(builder::zero(o));
      if (mx >= 0) p.prologue.push_back(builder::zero(mx));
      std::vector<instruction> rows;
      b.load_mapped(rows, k, 1, map_k);
      b.load_values(rows, v, m, false);
      rows.push_back(b.product(a, q, false, k, true, false));
      instruction running = exp_fixed;
      running.a = o;  // the running max, o rescaled
      rows.push_back(squared ? square : running);
      rows.push_back(b.product(o, a, false, v, false, true));
      p.passes.emplace_back(std::move(rows));
      // ĝ = rowdiv's adjoint of the shifted rows, kept (with m) for the key-major launch
      std::vector<instruction> adjoint = {builder::load(g, 3, m), builder::rowdiv_grad(g, o, eps)};
      adjoint.back().b = mx;
      adjoint.push_back(builder::store_to(g, 2, w));
      if (mx >= 0) adjoint.push_back(builder::store_to(mx, 3, 1));
      p.passes.emplace_back(std::move(keys), false, std::move(adjoint));
    } else {
      p.prologue.push_back(builder::load(g, 3, m));  // ĝ = ∂out
      p.passes.emplace_back(std::move(keys));
    }
    finish(p.epilogue, dx, 0, map_q, -1);
  } else {
    b.load_mapped(p.prologue, k, 1, map_k);
    b.load_values(p.prologue, v, m, false);
    p.prologue.push_back(builder::zero(dx));
    p.prologue.push_back(builder::zero(dv));
    std::vector<instruction> queries;
    b.load_mapped(queries, q, 0, map_q);
    queries.push_back(s.normalized ? builder::load(g, scratch, w) : builder::load(g, 3, m));
    if (mx >= 0) queries.push_back(builder::load(mx, shift, 1));
    queries.push_back(b.product(a, q, false, k, true, false));   // a = φQ·φKᵀ
    if (squared) {  // ∂S reads S before it is squared
      queries.push_back(b.product(ds, g, false, v, true, false)); // ds = ĝ·[V|1]ᵀ
      queries.push_back(square_grad);                              // ds = ∂S = 2·S∘ds
      queries.push_back(square);                                   // a = A = S²
      queries.push_back(b.product(dv, a, true, g, false, true));  // ∂[V|1] += Aᵀ·ĝ
    } else {
      queries.push_back(exp_fixed);                                // a = E
      queries.push_back(b.product(dv, a, true, g, false, true));  // ∂[V|1] += Eᵀ·ĝ
      queries.push_back(b.product(ds, g, false, v, true, false)); // ds = ĝ·[V|1]ᵀ
      queries.push_back(exp_grad);                                 // ds = ∂S
    }
    queries.push_back(b.product(dx, ds, true, q, false, true));   // ∂φK += ∂Sᵀ·φQ
    p.passes.emplace_back(std::move(queries));
    p.epilogue.push_back(builder::store_to(dv, 1, m));
    finish(p.epilogue, dx, 1, map_k, 0);
  }
  finish_layout(p);
  return p;
}

// The third program of a softmax spec's backward with a parametric map inside
// exp, at chunk T: a block per (batch, head) walks Q's rows, then K's, turning
// the ∂φ rows the quadratic launches stored into ∂Q, ∂K and the sums ∂W (∂W2)
// — builder::finish_grad, as the linear backward does per chunk.
program lay_out_softmax_param_grad(attention_spec const& s, int t) {
  builder b;
  program& p = b.p;
  b.start(s, {t, static_cast<int>(s.m), threads_of(s)});
  int const d = static_cast<int>(s.d), f = static_cast<int>(s.f);
  int const c = static_cast<int>(features(s.map_q, s.d, s.f));
  p.kernel_name = fmt::format("lina_softmax_{}_backward_w_{}_{}_d{}_m{}_f{}_t{}_{}_{}", s.causal ? "causal" : "full",
                              map_id(s, s.map_q), k_id_of(s), s.d, s.m, s.f, t, name_of(s.in), name_of(s.out));
  p.description = fmt::format("softmax attention, backward through the random features: ∂{}, ∂{}, ∂{}{} from the ∂φ "
                              "rows of the quadratic launches, of: {}",
                              s.q_name, s.k_name, s.w_name, s.w_k_name.empty() ? "" : ", ∂" + s.w_k_name, plan_text(s));
  p.inputs = {{s.q_name, "q"}, {s.k_name, "k"}, {s.v_name, "v"}, {"∂out", "dout"}};
  p.out_name = "∂" + s.q_name;
  p.extras = softmax_backward_extras(s);
  b.w_slot = 4;
  b.feature_registers(s, t);
  int const dx = b.reg("dx", t, c, "∂φ(Q) or ∂φ(K) rows (T, C)");
  int const gx = b.reg("gx", t, d, "∂Q or ∂K rows through x·W (T, D)");
  b.dw = b.reg("dw", d, f, "∂" + s.w_name + " = Σ xᵀ·∂z over the rows so far, fp32 (D, F)");
  b.dwk = s.w_k_name.empty() ? -1 : b.reg("dwk", d, f, "∂" + s.w_k_name + " = Σ kᵀ·∂z over K's rows so far, fp32 (D, F)");
  b.load_w(p.prologue);
  for (int r : {b.dw, b.dwk})
    if (r >= 0) {
      p.prologue.push_back(builder::zero(r));
      instruction out = builder::store_to(r, static_cast<int>(extra_named(p, r == b.dw ? "∂" + s.w_name : "∂" + s.w_k_name)), f);
      out.whole = true;
      p.epilogue.push_back(out);
    }
  for (bool keys : {false, true}) {
    feature_map const mp = keys ? s.map_k : s.map_q;
    if (!parametric(mp)) continue;
    std::string const& x = keys ? s.k_name : s.q_name;
    std::vector<instruction> rows{builder::load(dx, max_inputs + static_cast<int>(extra_named(p, "∂φ(" + x + ")")), c)};
    b.finish_grad(rows, dx, gx, keys ? 1 : 0, mp, keys ? 0 : -1);
    p.passes.emplace_back(std::move(rows));
    p.passes.back().keys = keys;
  }
  finish_layout(p);
  return p;
}
}  // namespace

namespace {
// A plan that reads one input twice (program.hpp, backward_programs_of): in
// the order the programs store them, each later share's stores add to the
// buffer the first share of its input wrote, and the kernels are named for it.
void tie_shares(std::vector<program>& ps) {
  attention_spec const& s = ps.front().spec;
  auto input_of = [&](int slot) { return slot < 0 ? s.q_name : slot == 0 ? s.k_name : s.v_name; };  // out, ∂K, ∂V
  if (s.q_name != s.k_name && s.q_name != s.v_name && s.k_name != s.v_name) return;
  std::vector<std::pair<std::string, int>> first;  // an input's first-stored share: (input, slot)
  auto visit = [&](instruction& i) {
    if (i.op != opcode::store || i.whole || i.slot > 1) return;  // (∂W, scratch: not shares)
    std::string const x = input_of(i.slot);
    auto const at = std::find_if(first.begin(), first.end(), [&](auto const& f) { return f.first == x; });
    if (at == first.end())
      first.emplace_back(x, i.slot);
    else
      i.accumulate = at->second != i.slot;
  };
  for (program& p : ps) {
    for_each_list(p, [&](std::vector<instruction>& list) {
      for (auto& i : list) visit(i);
    });
    p.kernel_name += s.q_name == s.k_name && s.k_name == s.v_name ? "_same_qkv"
                     : s.q_name == s.k_name                      ? "_same_qk"
                     : s.q_name == s.v_name                      ? "_same_qv"
                                                                 : "_same_kv";
    p.description += fmt::format(" — reading {} twice: its gradient is the sum of its shares",
                                 s.k_name == s.v_name ? s.k_name : s.q_name);
  }
}
}  // namespace

namespace {
// The backward program of a linear spec at the longest chunk that fits, if
// any; its shares of an input read twice tied (tie_shares), unless `tie` is false.
std::optional<program> fitting_backward(attention_spec const& s, bool tie = true) {
  check_tile_request(s.tiles);
  for (int t : chunks_of(s)) {
    std::vector<program> p{lay_out_backward(s, t)};
    if (p[0].shared_bytes() > shared_memory_budget) continue;
    if (tie) tie_shares(p);
    return std::move(p[0]);
  }
  return std::nullopt;
}

std::string too_large(attention_spec const& s, std::string_view why) {
  int const t = chunks_of(s).back();
  return fmt::format("lina::cuda: D = {}, M = {} is too large for the backward kernel: one block holds the whole C × "
                     "(M+1) state and, at T = {}{}, needs {} bytes of shared memory, more than the {} a block may use{}",
                     s.d, s.m, t, s.tiles.chunk > 0 ? " (requested)" : "", lay_out_backward(s, t).shared_bytes(),
                     shared_memory_budget, why);
}

// A linear spec's backward over slices of M's columns (program.hpp,
// backward_programs_of): everything after the rows is linear in ĝ, so each
// slice's program — the backward of an M' = ⌈M / P⌉ spec on its columns of V,
// ∂out and ∂V, with the ones column and rowdiv's adjoint on its own columns —
// gives its share of ∂Q, ∂K and ∂W. The slices before the last store their
// shares to fp32 sums (the first writes, the others add); the last adds the
// sums to its own share and stores the gradient, rounded once.
std::vector<program> sliced_backward(attention_spec const& s) {
  // Q read as V too: the last slice's forward walk cannot add ∂Q to the
  // gradient yet — its own reverse walk writes its ∂V columns later. So it
  // adds its share to the fp32 sums like the others, and its last pass adds
  // the sums to each chunk's rows after their ∂V columns are stored.
  bool const q_as_v = s.q_name == s.v_name;
  for (std::size_t slices = 2; slices <= s.m; ++slices) {
    attention_spec slice = s;
    slice.m = (s.m + slices - 1) / slices;
    std::optional<program> fits = fitting_backward(slice, false);  // (tied below, over all the slices)
    if (!fits) continue;
    program base = std::move(*fits);
    // The fp32 sums of the gradients that sum over M: ∂Q (out) and the extras marked so (∂K, ∂W, ∂W2).
    std::size_t const extras = base.extras.size();
    std::vector<int> sums_of(extras + 1, -1);  // a store's slot + 1 → the slot of its sums
    auto add_sums = [&](int slot, extra_buffer e) {
      sums_of[static_cast<std::size_t>(slot + 1)] = static_cast<int>(base.extras.size());
      e.name += " sums", e.type = dtype::f32, e.sums_over_m = false;
      e.comment = "the earlier slices' shares of " + e.name.substr(0, e.name.size() - 5) + ", fp32";
      base.extras.push_back(std::move(e));
    };
    add_sums(-1, {"∂" + s.q_name, dtype::f32, "", false, s.d});
    for (std::size_t e = 0; e < extras; ++e) {
      extra_buffer x = base.extras[e];
      if (!x.sums_over_m) continue;
      if (x.name == "∂" + s.k_name) x.cols = s.d;
      else x.rows = s.d, x.cols = s.f;  // ∂W, ∂W2: [B, H, D, F]
      add_sums(static_cast<int>(e), std::move(x));
    }
    if (base.extras.size() > static_cast<std::size_t>(max_extras))
      throw std::logic_error("lina::cuda: a split backward needs more than max_extras buffers");
    std::size_t const count = (s.m + slice.m - 1) / slice.m;
    std::vector<program> ps;
    for (std::size_t t = 0; t < count; ++t) {
      program x = base;
      bool const last = t + 1 == count;
      std::optional<instruction> dq_late;  // Q as V: the ∂Q store the last pass makes, from the sums
      auto rewrite = [&](std::vector<instruction>& list) {
        std::vector<instruction> out;
        for (instruction i : list) {
          // Chained: R, the reverse walk's state, starts from ∂(the state out),
          // whose z column every slice's ∂K reads through its ones column: the
          // first slice counts it, the later ones start their z at 0 (a load of
          // their V columns only) and add their shares of ∂z to the first's in
          // ∂S0 (store_state, accumulate).
          if (t > 0 && i.op == opcode::load_state && i.slot >= 0)
            i.z_column = false, i.width = static_cast<int>(std::min(slice.m, s.m - t * slice.m));
          if (t > 0 && i.op == opcode::store_state) i.accumulate = true;
          bool const summed = i.op == opcode::store && !i.accumulate && static_cast<std::size_t>(i.slot + 1) < sums_of.size();
          int const sums = summed ? sums_of[static_cast<std::size_t>(i.slot + 1)] : -1;
          if (sums >= 0 && last && q_as_v && i.slot < 0) {  // ∂Q to the sums now, to the gradient in the last pass
            dq_late = i;
            i.slot = sums, i.accumulate = true;
          } else if (sums >= 0 && last) {  // the register += the sums, then the store of the gradient
            instruction add = i;
            add.op = opcode::load, add.slot = max_inputs + sums, add.accumulate = true;
            out.push_back(add);
          } else if (sums >= 0) {
            i.slot = sums, i.accumulate = t > 0;
          }
          out.push_back(i);
        }
        list = std::move(out);
      };
      for_each_list(x, rewrite);
      if (dq_late) {  // each chunk's ∂Q rows (all the slices' shares) after the pass stored its ∂V columns
        instruction reload = builder::load(dq_late->dst, max_inputs + sums_of[0], dq_late->width);
        x.passes.back().push_back(reload);
        x.passes.back().push_back(*dq_late);
      }
      x.v_offset = t * slice.m;
      x.kernel_name += t == 0 ? "_slice_first" : last ? "_slice_last" : "_slice_adding";
      x.description += fmt::format(" — slice {} of {} of M's columns: {}", t + 1, count,
                                   t == 0 ? "its shares of the gradients that sum over M to fp32 sums"
                                   : last ? "its shares plus the earlier slices' sums, stored as the gradients"
                                          : "its shares added to the fp32 sums");
      ps.push_back(std::move(x));
    }
    // An input read twice (Q as K, K as V): in launch order its first-stored
    // share writes and the later ones add — the slices' ∂V columns each write
    // their own, the ∂Q and ∂K shares reach memory only in the last slice.
    tie_shares(ps);
    return ps;
  }
  throw std::invalid_argument(too_large(s, ", even for one column of M"));
}
}  // namespace

namespace {
// p without the registers none of its instructions names (the others renumbered,
// their order kept): a launch laid out with a larger program's registers
// reserves only the shared memory it uses.
void drop_unused_registers(program& p) {
  std::vector<int> renumber(p.registers.size(), -1);
  auto mark = [&](std::vector<instruction>& list) {
    for (instruction const& i : list)
      for (int r : {i.dst, i.a, i.b})
        if (r >= 0) renumber.at(static_cast<std::size_t>(r)) = 0;
  };
  for_each_list(p, mark);
  std::vector<tile_register> kept;
  for (std::size_t r = 0; r < p.registers.size(); ++r)
    if (renumber[r] == 0) renumber[r] = static_cast<int>(kept.size()), kept.push_back(p.registers[r]);
  p.registers = std::move(kept);
  for_each_list(p, [&](std::vector<instruction>& list) {
    for (instruction& i : list)
      for (int* r : {&i.dst, &i.a, &i.b})
        if (*r >= 0) *r = renumber[static_cast<std::size_t>(*r)];
  });
}
}  // namespace

static std::vector<program> build_split_backward_programs(attention_spec const& s) {
  bool const param = parametric(s.map_q) || parametric(s.map_k);
  if (s.softmax || s.step || s.d == 0 || s.m == 0) return {};
  check_maps(s);
  std::optional<program> const whole = fitting_backward(s, false);
  if (!whole) return {};  // (split over M's columns instead)
  int const t = whole->tiles.chunk;
  struct part_of {
    backward_part part;
    char const* suffix;
    char const* what;
  };
  std::vector<program> ps;
  for (auto [part, suffix, what] :
       {part_of{backward_part::sums, "_split_sums", "each group's Σ φ(K)ᵀ[V|1] (the chunk-parallel form's first launch)"},
        part_of{backward_part::adjoint_sums, "_split_adjoint_sums",
                "each group's Σ φ(Q)ᵀĝ, its rows' adjoint ĝ kept (the chunk-parallel form's second launch)"},
        part_of{backward_part::walks, "_split_walks",
                "each group's forward and reverse walks from the sums of the groups before and after it (the "
                "chunk-parallel form's third launch)"},
        part_of{backward_part::weight_sums, "_split_w_sums",
                "the groups' shares of ∂W added in their order (a parametric map's fourth launch)"}}) {
    if (part == backward_part::weight_sums && !param) continue;
    program p = lay_out_backward(s, t, part);
    drop_unused_registers(p);
    p.kernel_name += suffix;
    p.description += std::string(" — ") + what;
    ps.push_back(std::move(p));
  }
  tie_shares(ps);  // (only the walks store gradients)
  return ps;
}

static std::vector<program> build_backward_programs(attention_spec const& s) {
  // poly2 whose state does not fit even one column of M per launch: through its kernel, as softmax.
  auto sliceable = [&] {
    attention_spec one = s;
    one.m = 1;
    return fitting_backward(one, false).has_value();
  };
  if (!s.softmax && !(kernel_trick(s) && s.d > 0 && s.m > 0 && !sliceable())) {
    if (s.step || s.d == 0 || s.m == 0 || (s.chained && !s.causal)) return {backward_program_of(s)};  // (its errors)
    check_maps(s);
    if (std::optional<program> p = fitting_backward(s)) return {std::move(*p)};
    return sliced_backward(s);
  }
  if (s.step) throw std::invalid_argument("lina::cuda: a decoding step has no backward kernel");
  if (s.chained) throw std::invalid_argument("lina::cuda: softmax attention has no state to carry");
  if (s.d == 0 || s.m == 0) throw std::invalid_argument("lina::cuda: D and M must be at least 1");
  check_maps(s);
  check_tile_request(s.tiles);
  for (int t : chunks_of(s)) {
    std::vector<program> ps{lay_out_softmax_backward(s, t, false), lay_out_softmax_backward(s, t, true)};
    if (parametric(s.map_q) || parametric(s.map_k)) ps.push_back(lay_out_softmax_param_grad(s, t));
    if (std::any_of(ps.begin(), ps.end(), [](program const& p) { return p.shared_bytes() > shared_memory_budget; })) continue;
    tie_shares(ps);
    return ps;
  }
  throw std::invalid_argument(fmt::format(
      "lina::cuda: D = {}, M = {} is too large for softmax's backward kernels: one block holds every column and, at "
      "T = {}{}, needs {} bytes of shared memory, more than the {} a block may use (splitting M over blocks: not yet)",
      s.d, s.m, chunks_of(s).back(), s.tiles.chunk > 0 ? " (requested)" : "",
      lay_out_softmax_backward(s, chunks_of(s).back(), false).shared_bytes(), shared_memory_budget));
}

program backward_program_of(attention_spec const& s) {
  if (s.softmax)
    throw std::invalid_argument("lina::cuda: the backward of softmax attention takes two launches: backward_programs_of");
  if (s.step) throw std::invalid_argument("lina::cuda: a decoding step has no backward kernel");
  if (s.chained && !s.causal)
    throw std::invalid_argument("lina::cuda: only a causal attention carries a state, so only its backward takes one");
  if (s.d == 0 || s.m == 0) throw std::invalid_argument("lina::cuda: D and M must be at least 1");
  check_maps(s);
  if (std::optional<program> p = fitting_backward(s)) return std::move(*p);
  throw std::invalid_argument(too_large(s, " (backward_programs_of splits M's columns over launches)"));
}

bool splits(attention_spec const& s) { return !quadratic_form(s); }

static split_programs build_split_programs(attention_spec const& s) {
  if (quadratic_form(s)) throw std::invalid_argument("lina::cuda: the chunk-parallel form is for linear forwards");
  if (s.chained && !s.causal)
    throw std::invalid_argument("lina::cuda: only a causal attention carries a state, so only its split form takes one");
  // The partials never see the state: a chained spec's are the unchained one's (one kernel for both).
  attention_spec unchained = s;
  unchained.chained = false;
  program scan = program_of(s);
  program partials = program_of(unchained);
  auto reg = [&](char const* name) {
    for (std::size_t r = 0; r < scan.registers.size(); ++r)
      if (scan.registers[r].name == name) return static_cast<int>(r);
    throw std::logic_error(std::string("lina::cuda: a linear program without a register ") + name);
  };
  int const st = reg("state"), k = reg("k"), pw = decayed(s) ? reg("pw") : -1;
  instruction const partial_op{.op = opcode::store_partial, .dst = st, .slot = 0, .width = scan.tiles.tile_m, .by_m_tile = true,
                               .z_column = s.normalized, .causal = s.causal};
  instruction const add_op{.op = opcode::add_partials, .dst = st, .b = pw, .slot = 0, .width = scan.tiles.tile_m, .by_m_tile = true,
                           .z_column = s.normalized, .causal = s.causal};
  if (s.causal) {
    // partials: the group's Σ φ(K)ᵀ[V|1] — the scan's loads of K and V and its state update
    // (decayed: with its weights, so the sums are the group's state at its last row from 0).
    // K's block runs from its load to the instruction that writes φ(K) into k
    // (a load, or a map — after x·W for a parametric map).
    std::vector<instruction> sum;
    bool in_k = false;
    for (auto const& i : scan.passes.at(0)) {
      in_k = in_k || (i.op == opcode::load && i.slot == 1);
      bool const v = (i.op == opcode::load && i.slot == 2) || i.op == opcode::ones_column ||
                     (i.op == opcode::prefetch && (i.slot == 1 || i.slot == 2));  // (K's too: a hint)
      bool const maps_k = i.op == opcode::map && i.dst == k;  // (an element-wise map after the load of k)
      bool const update = (i.op == opcode::product || i.op == opcode::decay_rows) && i.dst == st;
      bool const weighs_k = i.op == opcode::decay_rows && i.dst == k;
      if (in_k || v || maps_k || update || weighs_k) sum.push_back(i);
      if (in_k && (i.op == opcode::load || i.op == opcode::map) && i.dst == k) in_k = false;
    }
    partials.passes = {pass(std::move(sum))};
  } else {
    // The non-causal program's passes already are the two halves: Σ φ(K)ᵀ[V|1]
    // over K's rows, then the rows of Q against it.
    partials.passes.resize(1);
    partials.key_major = true;  // groups of K's rows
    scan.passes.erase(scan.passes.begin());
  }
  partials.epilogue = {partial_op};
  partials.split = true;
  partials.kernel_name += "_partials";
  partials.description = "the sums of φ(K)ᵀ" + std::string(s.normalized ? "[V|1]" : "V") +
                         " per group of rows (the chunk-parallel form's first launch) of: " + plan_text(s);
  partials.extras = {{.name = "partials", .type = dtype::f32,
                      .comment = "Σ φ(K)ᵀ[V|1] per group of rows, fp32 [B, H, groups·C, W]", .keys = true}};
  scan.prologue.push_back(add_op);  // after load_state, when chained: S0 + the groups before
  scan.split = true;
  scan.kernel_name += "_split";
  scan.description += !s.causal ? " (chunk-parallel: each group of rows starts from the sums of every group of K's rows)"
                      : s.chained
                          ? " (chunk-parallel: each group of rows starts from the state in and the sums of the groups "
                            "before it; the last group stores the state out)"
                          : " (chunk-parallel: each group of rows starts from the sums of the groups before it)";
  scan.extras = partials.extras;
  return {std::move(partials), std::move(scan)};
}

std::vector<program> kernels_of(attention_spec s) {
  std::vector<program> out;
  auto add = [&](program p) {
    for (program const& q : out)
      if (q.kernel_name == p.kernel_name && q.description == p.description) return;
    out.push_back(std::move(p));
  };
  // Each variant as its launch makes it: one that throws std::invalid_argument
  // is one that a launch refuses too (the plan has no such form), so it needs no kernel.
  auto variant = [&](auto make) {
    try {
      make();
    } catch (std::invalid_argument const&) {
    }
  };
  s.step = false;
  for (bool chained : {false, true}) {
    s.chained = chained;
    if (chained && (!s.causal || quadratic_form(s))) break;  // (no state to carry)
    add(program_of(s));  // (throws for a spec no launch takes: maps that differ, no D or M)
    variant([&] {
      split_programs sp = split_programs_of(s);
      add(std::move(sp.partials)), add(std::move(sp.scan));
    });
    variant([&] {
      for (program& p : backward_programs_of(s)) add(std::move(p));
    });
    variant([&] {
      for (program& p : split_backward_programs_of(s)) add(std::move(p));
    });
    if (chained) {
      s.step = true;
      variant([&] { add(program_of(s)); });
    }
  }
  return out;
}

program add_program(dtype t, std::size_t cols) {
  if (cols == 0) throw std::invalid_argument("lina::cuda::add_program: no columns");
  builder b;
  program& p = b.p;
  attention_spec s;
  s.causal = s.normalized = false;
  s.in = s.out = t;
  s.d = s.m = cols;
  s.description = "out += x";
  int const c = static_cast<int>(cols);
  int chunk = 64;
  while (chunk > 1 && static_cast<std::size_t>(chunk) * static_cast<std::size_t>(pitch_of(c)) * 4 > shared_memory_budget)
    chunk /= 2;
  b.start(s, {chunk, c, 256});
  p.kernel_name = fmt::format("lina_add_{}_c{}", name_of(t), cols);
  p.description = fmt::format("out += x, [B, H, n, {}] {}: the sum of two gradients of one input", cols, name_of(t));
  p.inputs = {{"x", "x"}};
  int const r = b.reg("t", chunk, c, "rows of x (T, cols)");
  instruction add = builder::store_to(r, -1, c);
  add.accumulate = true;
  p.passes.push_back(pass({builder::load(r, 0, c), add}));
  return p;
}

void check_heads(program const& p, forward_args const& a) {
  if (per_head(p.spec) && static_cast<std::int64_t>(p.spec.head_decays.size()) != a.heads)
    throw shape_error("decay per head", "H (heads)", p.spec.head_decays.size(), static_cast<std::size_t>(std::max<std::int64_t>(a.heads, 0)),
                      "of the bound inputs (head_decays: one per head; kernel " + p.kernel_name + ")");
}

std::int64_t split_rows(std::int64_t blocks, std::int64_t n, int chunk, int sms) {
  std::int64_t const chunks = (n + chunk - 1) / chunk;
  if (blocks <= 0 || blocks >= sms || chunks < 4) return 0;
  std::int64_t groups = std::min<std::int64_t>((2 * sms + blocks - 1) / blocks, chunks / 2);
  if (groups < 2) return 0;
  return (chunks + groups - 1) / groups * chunk;
}

std::int64_t split_rows(tile_request const& t, std::int64_t blocks, std::int64_t n, int chunk, int sms) {
  if (t.groups == 0) return split_rows(blocks, n, chunk, sms);
  std::int64_t const chunks = (n + chunk - 1) / chunk;
  std::int64_t const per_group = (chunks + t.groups - 1) / t.groups;
  return per_group > 0 && per_group < chunks ? per_group * chunk : 0;
}

void check_tile_request(tile_request const& t) {
  if (t.chunk != 0 && t.chunk != 16 && t.chunk != 32 && t.chunk != 64)
    throw std::invalid_argument(
        fmt::format("lina::cuda: a chunk of {} rows was requested; it is 16, 32 or 64 (0: lina chooses)", t.chunk));
  if (t.tile_m < 0)
    throw std::invalid_argument(
        fmt::format("lina::cuda: an M tile of {} columns was requested; it is at least 1 (0: lina chooses)", t.tile_m));
  if (t.threads != 0 && t.threads != 128 && t.threads != 256 && t.threads != 512)
    throw std::invalid_argument(fmt::format(
        "lina::cuda: blocks of {} threads were requested; they are 128, 256 or 512 (0: lina chooses)", t.threads));
  if (t.groups < 0)
    throw std::invalid_argument(fmt::format(
        "lina::cuda: {} groups of rows were requested; they are at least 1 (1: one pass; 0: lina chooses)", t.groups));
}

tile_config choose_tiles(attention_spec const& s) {
  if (s.d == 0 || s.m == 0) throw std::invalid_argument("lina::cuda: D and M must be at least 1");
  check_tile_request(s.tiles);
  // The first (T, M tile) that fits. M tiles of 32 or more come first: every
  // block of a (batch, head) reloads the φ(Q), φ(K) chunks, so narrow M tiles
  // multiply that traffic; a shorter chunk only costs more state passes.
  constexpr int order[][2] = {{64, 64}, {64, 32}, {32, 64}, {32, 32}, {16, 64}, {16, 32},
                              {64, 16}, {32, 16}, {16, 16}, {64, 8},  {32, 8},  {16, 8}};
  auto const lay_out = quadratic_form(s) ? lay_out_softmax : lay_out_linear;  // (decided once, not per candidate)
  auto const fits = [&](int t, int tm) {
    tile_config const c{t, static_cast<int>(std::min(static_cast<std::size_t>(tm), s.m)), threads_of(s)};
    return lay_out(s, c).shared_bytes() <= shared_memory_budget ? std::optional<tile_config>(c) : std::nullopt;
  };
  std::vector<int> const chunks = chunks_of(s);
  if (s.tiles.tile_m > 0) {  // that M tile, at the requested chunk or the longest that fits
    for (int t : chunks)
      if (auto c = fits(t, s.tiles.tile_m)) return *c;
  } else {
    for (auto const& [t, tm] : order)
      if (std::find(chunks.begin(), chunks.end(), t) != chunks.end())
        if (auto c = fits(t, tm)) return *c;
  }
  if (s.tiles.chunk > 0 || s.tiles.tile_m > 0) {
    int const t = chunks.back();
    int const tm = static_cast<int>(std::min<std::size_t>(s.tiles.tile_m > 0 ? static_cast<std::size_t>(s.tiles.tile_m) : 8, s.m));
    throw std::invalid_argument(fmt::format(
        "lina::cuda: the requested tiles (T = {}, M tile = {}) need {} bytes of shared memory at D = {}, M = {}, more "
        "than the {} a block may use: ask for a shorter chunk or a narrower M tile (0 leaves either to lina)",
        t, tm, lay_out(s, {t, tm, threads_of(s)}).shared_bytes(), s.d, s.m, shared_memory_budget));
  }
  throw std::invalid_argument(fmt::format(
      "lina::cuda: D = {} is too large: the smallest tiles (T = 16, 8 columns of M) need {} bytes of shared "
      "memory, more than the {} a block may use",
      s.d, lay_out(s, {16, static_cast<int>(std::min<std::size_t>(8, s.m)), 256}).shared_bytes(), shared_memory_budget));
}

static program build_program(attention_spec const& s) {
  if (s.chained && s.softmax)
    throw std::invalid_argument(
        "lina::cuda: softmax attention carries no state from one evaluation to the next: exp has no finite feature "
        "map, so every row reads all the keys before it");
  if (s.chained && !s.causal)
    throw std::invalid_argument(
        "lina::cuda: only a causal attention carries a state from one evaluation to the next: every row of a "
        "non-causal one reads the whole sequence, so it has no running state");
  if (s.step && !s.chained)
    throw std::invalid_argument("lina::cuda: a step program continues a state: make its spec chained");
  check_maps(s);
  return lay_out(s, choose_tiles(s));
}

std::string plan_text(attention_spec const& s) {
  auto mapped = [&](feature_map m, std::string const& x, std::string const& w) {
    if (parametric(m)) return fmt::format("φ[{}]({}; {})", name_of(m), x, w);
    if (user_defined(m)) return fmt::format("φ[{}]({})", user_of(s, m).name, x);
    return m == feature_map::identity ? x : fmt::format("φ[{}]({})", name_of(m), x);
  };
  std::string const q = mapped(s.map_q, s.q_name, s.w_name),
                    k = mapped(s.map_k, s.k_name, s.w_k_name.empty() ? s.w_name : s.w_k_name);
  std::string const v = s.normalized ? "[" + s.v_name + "|1]" : s.v_name;
  std::string const decay = per_head(s) ? fmt::format("; decay per head=[{}]", fmt::join(s.head_decays, ", "))
                            : decayed(s) ? fmt::format("; decay={}", s.decay)
                                         : "";
  if (s.softmax) {  // as compile() prints it: the scale, then causal, outside the scores
    std::string sc = fmt::format("{}·{}ᵀ", q, k);
    if (s.scale != 1) sc = fmt::format("{}·({})", s.scale, sc);
    if (s.mask_scores && !s.causal) sc = s.scale != 1 ? fmt::format("{}·causal({}·{}ᵀ)", s.scale, q, k)
                                                       : fmt::format("causal({})", sc);
    sc = fmt::format("exp({})", sc);
    if (s.causal) sc = fmt::format("causal({}{})", sc, decay);
    std::string core = fmt::format("{}·{}", sc, v);
    if (!s.normalized) return core;
    return s.eps == 1e-6 ? fmt::format("rowdiv({})", core) : fmt::format("rowdiv({}; eps={})", core, s.eps);
  }
  std::string core = s.causal ? fmt::format("contract({}, prefix({}⊗{}{}))", q, k, v, decay) : fmt::format("{}·({}ᵀ·{})", q, k, v);
  if (!s.normalized) return core;
  return s.eps == 1e-6 ? fmt::format("rowdiv({})", core) : fmt::format("rowdiv({}; eps={})", core, s.eps);
}

std::string listing(program const& p) {
  std::string r = fmt::format("{} — {}\nT = {}, M tile = {}, {} block(s) per (batch, head), {} threads, {} bytes shared\n",
                              p.kernel_name, p.description, p.tiles.chunk, p.tiles.tile_m, p.m_tiles, p.tiles.threads,
                              p.shared_bytes());
  for (std::size_t e = 0; e < p.extras.size(); ++e)
    r += fmt::format("  extra[{}] {} ({}): {}\n", e, p.extras[e].name, name_of(p.extras[e].type), p.extras[e].comment);
  for (auto const& reg : p.registers)
    r += fmt::format("  {} ({}×{} {}, pitch {}): {}\n", reg.name, reg.rows, reg.cols, name_of(reg.storage), reg.pitch(),
                     reg.comment);
  auto source = [&](int slot) {
    return slot < max_inputs ? p.inputs.at(static_cast<std::size_t>(slot)).name
                             : p.extras.at(static_cast<std::size_t>(slot - max_inputs)).name;
  };
  auto one = [&](instruction const& i) {
    auto nm = [&](int x) { return p.registers[static_cast<std::size_t>(x)].name; };
    switch (i.op) {
      case opcode::prefetch:
        return fmt::format("prefetch {}[next chunk, {}{} cols] to L2", source(i.slot), i.by_m_tile ? "m_tile·tile_m + " : "",
                           i.width);
      case opcode::load: {
        std::string_view const op = i.accumulate ? "+=" : "←";  // (a split backward adds the earlier slices' sums)
        if (i.whole) return fmt::format("load {} {} {} (all {} rows, {} cols)", nm(i.dst), op, source(i.slot), p.registers[static_cast<std::size_t>(i.dst)].rows, i.width);
        return fmt::format("load {} {} {}[:, {}{} cols]", nm(i.dst), op, source(i.slot), i.by_m_tile ? "m_tile·tile_m + " : "",
                           i.width);
      }
      case opcode::map:
        if (i.b >= 0) return fmt::format("map {} ← φ[{}]({}; {} = {}·W)", nm(i.dst), name_of(i.map), nm(i.a), nm(i.b), nm(i.a));
        return i.a >= 0 ? fmt::format("map {} ← φ[{}]({})", nm(i.dst), name_of(i.map), nm(i.a))
                        : fmt::format("map {} φ[{}]", nm(i.dst), name_of(i.map));
      case opcode::product: {
        auto tri = [](triangle t) { return t == triangle::lower ? "lower" : "upper"; };
        return fmt::format("{} {} {}{}·{}{} ({}{}{})", nm(i.dst), i.accumulate ? "+=" : "=", nm(i.a),
                           i.transpose_a ? "ᵀ" : "", nm(i.b), i.transpose_b ? "ᵀ" : "", name_of(i.prec),
                           i.tri_t == triangle::none ? "" : fmt::format(", {}'s {} tiles alone", nm(i.dst), tri(i.tri_t)),
                           i.tri_a == triangle::none ? "" : fmt::format(", {}'s {} tiles alone", nm(i.a), tri(i.tri_a)));
      }
      case opcode::mask_causal:
      case opcode::mask_anticausal:
        return i.b >= 0 ? fmt::format("{} {}, weighed by {}", name_of(i.op), nm(i.dst), nm(i.b))
                        : fmt::format("{} {}", name_of(i.op), nm(i.dst));
      case opcode::powers:
        return per_head(p.spec) ? fmt::format("powers {} = g^k, g = the head's", nm(i.dst))
                                : fmt::format("powers {} = g^k, g = {}", nm(i.dst), p.spec.decay);
      case opcode::decay_rows:
        return fmt::format("decay_rows {} ·= {}[{}]", nm(i.dst), nm(i.b),
                           i.power == decay_power::row_plus_one   ? "row + 1"
                           : i.power == decay_power::to_chunk_end ? "rows − 1 − row"
                                                                  : "rows (every row)");
      case opcode::row_divide:
        return i.b >= 0 ? fmt::format("row_divide {} eps={}·exp(−{})", nm(i.dst), i.eps, nm(i.b))
                        : fmt::format("row_divide {} eps={}", nm(i.dst), i.eps);
      case opcode::exp_rows:
        return fmt::format("exp_rows {} = exp({}·{} − {}){}{}{}", nm(i.dst), i.scale, nm(i.dst),
                           i.b >= 0 ? nm(i.b) : "0",
                           i.causal ? ", keys after the row masked" : i.mask_scores ? ", scores after the row 0" : "",
                           !i.decayed     ? ""
                           : per_head(p.spec) ? std::string(", decayed: + (row − key)·ln g of the head")
                                              : fmt::format(", decayed: + (row − key)·{}", log_decay(p.spec)),
                           i.b < 0    ? ""
                           : i.a >= 0 ? fmt::format("; {} grows to the row max, {} rescaled", nm(i.b), nm(i.a))
                                      : fmt::format("; {} fixed (the forward's final shift)", nm(i.b)));
      case opcode::exp_grad:
        return fmt::format("exp_grad {} = {}·{}∘{}{}", nm(i.dst), i.scale, nm(i.a), nm(i.dst),
                           i.causal || i.mask_scores ? ", 0 after the row" : "");
      case opcode::square_rows:
        return fmt::format("square_rows {} = {}²{}", nm(i.dst), nm(i.dst), i.causal ? ", 0 after the row" : "");
      case opcode::square_grad:
        return fmt::format("square_grad {} = 2·{}∘{}{}", nm(i.dst), nm(i.a), nm(i.dst), i.causal ? ", 0 after the row" : "");
      case opcode::store:
        if (i.slot >= 0)
          return fmt::format("store {} → {}[:, {} cols]{}", nm(i.dst), p.extras.at(static_cast<std::size_t>(i.slot)).name,
                             i.width, i.accumulate ? ", added to what is there" : "");
        return fmt::format("store {} → {}[:, {}{} cols]", nm(i.dst), p.out_name, i.by_m_tile ? "m_tile·tile_m + " : "", i.width);
      case opcode::param_grad:
        return fmt::format("param_grad {} = {}·{}ᵀ{}", nm(i.dst), nm(i.a), nm(i.b),
                           i.map == feature_map::favor ? fmt::format(" − {}·{}·Σ{}", i.scale, source(i.slot), nm(i.a)) : "");
      case opcode::map_grad:
        if (parametric(i.map))
          return fmt::format("map_grad {} ← ∂z of φ[{}]({}; {}) from ∂φ {}", nm(i.dst), name_of(i.map), nm(i.b), nm(i.dst), nm(i.a));
        return i.a >= 0 ? fmt::format("map_grad {} ← φ[{}]′({})ᵀ·{}", nm(i.dst), name_of(i.map), source(i.slot), nm(i.a))
                        : fmt::format("map_grad {} ·= φ[{}]′({})", nm(i.dst), name_of(i.map), source(i.slot));
      case opcode::rowdiv_grad:
        return fmt::format("rowdiv_grad {} (rows {}) eps={}{}", nm(i.dst), nm(i.a), i.eps,
                           i.b >= 0 ? fmt::format("·exp(−{})", nm(i.b)) : "");
      case opcode::store_partial:
        return fmt::format("store_partial {} → {}[group, :, m_tile·tile_m + {} cols{}]{}", nm(i.dst),
                           p.extras.at(static_cast<std::size_t>(i.slot)).name, i.width, i.z_column ? " | z (m_tile 0)" : "",
                           i.later ? " (not the first group)" : i.causal ? " (not the last group)" : "");
      case opcode::add_partials:
        return fmt::format("add_partials {} += Σ {}[{}, :, m_tile·tile_m + {} cols{}]", nm(i.dst),
                           p.extras.at(static_cast<std::size_t>(i.slot)).name,
                           i.later ? "g > group" : i.causal ? "g < group" : "every group", i.width, i.z_column ? " | z" : "");
      case opcode::load_state:
        return fmt::format("load_state {} ← {}[:, m_tile·tile_m + {} cols{}]", nm(i.dst),
                           i.slot >= 0 ? p.extras.at(static_cast<std::size_t>(i.slot)).name : std::string("state_in"),
                           i.width, i.z_column ? " | z" : "");
      case opcode::store_state:
        return fmt::format("store_state {} → state_out[:, m_tile·tile_m + {} cols{}]{}", nm(i.dst), i.width,
                           i.z_column ? " | z (m_tile 0)" : "",
                           !p.split ? "" : i.later ? " (the first group)" : " (the last group)");
      default: return fmt::format("{} {}", name_of(i.op), nm(i.dst));
    }
  };
  for (auto const& i : p.prologue) r += "  " + one(i) + "\n";
  for (auto const& pass : p.passes) {
    for (auto const& i : pass.before) r += "  " + one(i) + "\n";
    r += pass.reverse  ? (p.split ? "  for each chunk of the group, last first:\n" : "  for each chunk, last first:\n")
         : p.split    ? "  for each chunk of the group:\n"
         : p.key_major ? (p.spec.causal ? "  for each chunk of queries from this block's key rows on:\n"
                                        : "  for each chunk of queries:\n")
         : p.quadratic ? (p.spec.causal ? "  for each chunk of keys up to this block's query rows:\n"
                                        : "  for each chunk of keys:\n")
         : pass.keys   ? "  for each chunk of K and V:\n"
                       : "  for each chunk:\n";
    for (auto const& i : pass) r += "    " + one(i) + "\n";
  }
  for (auto const& i : p.epilogue) r += "  " + one(i) + "\n";
  return r;
}

bool overlap(operand const& x, operand const& y, std::int64_t batch, std::int64_t heads, std::int64_t rows) {
  if (batch <= 0 || heads <= 0 || rows <= 0 || x.cols <= 0 || y.cols <= 0 || !x.data || !y.data) return false;
  auto span = [&](operand const& o) {
    auto const* first = static_cast<char const*>(o.data);
    std::int64_t last = (batch - 1) * o.stride[0] + (heads - 1) * o.stride[1] + (rows - 1) * o.stride[2] +
                        (o.cols - 1) * o.stride[3];
    return std::pair{first, first + (last + 1) * static_cast<std::int64_t>(sizeof(float))};
  };
  auto [x0, x1] = span(x);
  auto [y0, y1] = span(y);
  return x0 < y1 && y0 < x1;
}

// The programs of the last specs asked for: a launch asks for its spec's
// program at every call (evaluate_into, each step of a training loop), and
// building one took 8–16 µs (2-core development machine, 2026-12-04), about
// what a small kernel runs. Building is a function of the spec alone.
namespace {
template <class R>
class memo {
 public:
  R get(attention_spec const& s, R (*build)(attention_spec const&)) {
    {
      std::lock_guard lock(mutex_);
      for (auto e = entries_.rbegin(); e != entries_.rend(); ++e)  // (the latest first)
        if (e->first == s) return e->second;
    }
    R r = build(s);  // (not under the lock: building asks for other programs)
    std::lock_guard lock(mutex_);
    if (entries_.size() == capacity) entries_.erase(entries_.begin());
    entries_.emplace_back(s, r);
    return r;
  }

 private:
  static constexpr std::size_t capacity = 32;
  std::mutex mutex_;
  std::vector<std::pair<attention_spec, R>> entries_;
};
}  // namespace

program program_of(attention_spec const& s) {
  static memo<program> m;
  return m.get(s, build_program);
}
split_programs split_programs_of(attention_spec const& s) {
  static memo<split_programs> m;
  return m.get(s, build_split_programs);
}
std::vector<program> backward_programs_of(attention_spec const& s) {
  static memo<std::vector<program>> m;
  return m.get(s, build_backward_programs);
}
std::vector<program> split_backward_programs_of(attention_spec const& s) {
  static memo<std::vector<program>> m;
  return m.get(s, build_split_backward_programs);
}

}  // namespace lina::cuda
