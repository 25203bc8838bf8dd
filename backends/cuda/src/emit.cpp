// The emitter (see emit.hpp): each instruction of the program becomes one call
// of a block-wide tile operation of tiles.cuh, with its shapes as template
// arguments.
#include "lina/cuda/emit.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <vector>

namespace lina::cuda {

std::string_view tiles_header() {
  static constexpr char text[] =
#include "lina_tiles_source.inc"
      ;
  return {text, sizeof(text) - 1};
}

namespace {

std::string_view element_tag(dtype t) {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "?";
}
// The type a kernel names a map by: lina::tile's, or the kernel's own struct
// for a user-defined map (a struct the kernel source defines at its top).
std::string_view map_tag(feature_map m) {
  switch (m) {
    case feature_map::identity: return "tl::identity";
    case feature_map::elu_plus_one: return "tl::elu_plus_one";
    case feature_map::relu: return "tl::relu";
    case feature_map::poly2: return "tl::poly2";
    case feature_map::favor: return "tl::favor";
    case feature_map::random_fourier: return "tl::random_fourier";
    case feature_map::user0: return "user0";
    case feature_map::user1: return "user1";
  }
  return "?";
}
std::string_view yes(bool b) { return b ? "true" : "false"; }

struct emitter {
  program const& p;
  std::string out;

  std::string const& name(int r) const { return p.registers.at(static_cast<std::size_t>(r)).name; }
  std::string rows(int r) const { return name(r) + "_rows"; }
  std::string cols(int r) const { return name(r) + "_cols"; }
  std::string pitch(int r) const { return name(r) + "_pitch"; }

  // Columns a load or store touches: tile_m for this block's columns of M, else a number.
  std::string width(cuda::instruction const& i) const {
    return i.by_m_tile && i.width == p.tiles.tile_m ? std::string("tile_m") : std::to_string(i.width);
  }

  template <class... A>
  void line(int indent, fmt::format_string<A...> f, A&&... a) {
    out.append(static_cast<std::size_t>(indent), ' ');
    out += fmt::format(f, std::forward<A>(a)...);
    out += '\n';
  }

  // The first query and the first key of a quadratic program's scores (program.hpp, exp_rows).
  std::string_view scores_at() const { return p.key_major ? "r0, key0" : "query0, r0"; }

  static bool fusable(cuda::instruction const& load, cuda::instruction const& map) {
    return load.op == opcode::load && map.op == opcode::map && map.a < 0 && map.dst == load.dst;
  }
  // A product that computes only the triangle the mask after it keeps
  // (program.cpp, skip_masked_tiles) and that mask: one tl::product whose
  // stores zero the masked elements (tl::tri_causal, tl::tri_anticausal) —
  // unless the mask is decayed (it weighs what it keeps: a pass of its own).
  static bool masks_fusable(cuda::instruction const& product, cuda::instruction const& mask) {
    return product.op == opcode::product && mask.dst == product.dst && mask.b < 0 &&
           ((mask.op == opcode::mask_causal && product.tri_t == triangle::lower) ||
            (mask.op == opcode::mask_anticausal && product.tri_t == triangle::upper));
  }

  // rowdiv and the store of its rows after it: one tl::row_divide_store, a
  // pass over the tile instead of two and no barrier between (the forward's last two).
  static bool divide_store_fusable(cuda::instruction const& divide, cuda::instruction const& store) {
    return divide.op == opcode::row_divide && divide.b < 0 && store.op == opcode::store && store.dst == divide.dst &&
           !store.whole && !store.accumulate;
  }

  // The memory of a load slot: args.in[s] (element type in_type, base in{s}_base)
  // or, past the inputs, an extra buffer (its own element type).
  struct memory {
    std::string operand, base, type;
  };
  memory source(int slot) const {
    if (slot < max_inputs) return {fmt::format("args.in[{}]", slot), fmt::format("in{}_base", slot), "in_type"};
    return sink(slot - max_inputs);
  }
  // A store's memory: args.out (out_type), or args.extra[s] (its element type).
  memory sink(int slot) const {
    if (slot < 0) return {"args.out", "out_base", "out_type"};
    return {fmt::format("args.extra[{}]", slot), fmt::format("extra{}_base", slot),
            fmt::format("tl::{}", element_tag(p.extras.at(static_cast<std::size_t>(slot)).type))};
  }

  // A load, or (with a map) a load followed by that element-wise map.
  void load(int ind, cuda::instruction const& i, std::string_view map) {
    std::string const& t = name(i.dst);
    memory const m = source(i.slot);
    // The block's threads where they differ from the default (its loops take them as a constant).
    std::string const threads = p.tiles.threads != 256 ? fmt::format(", {}", p.tiles.threads) : "";
    if (i.accumulate)  // t += an fp32 buffer (a split backward's sums)
      line(ind, "tl::load_add<{}, {}, {}>({}, {}, {}, {}, {}, {}, {});  // the earlier slices' sums added", rows(i.dst),
           cols(i.dst), pitch(i.dst), t, m.operand, m.base, i.whole ? "0" : "r0", i.by_m_tile ? "m0" : "0",
           i.whole ? rows(i.dst) : "rows", i.whole ? std::to_string(i.width) : width(i));
    else if (i.whole)  // all rows of the operand (W), once
      line(ind, "tl::load<{}, {}, {}, {}{}>({}, {}, {}, 0, 0, {}, {});", m.type, rows(i.dst), cols(i.dst), pitch(i.dst),
           threads, t, m.operand, m.base, rows(i.dst), i.width);
    else if (map.empty())
      line(ind, "tl::load<{}, {}, {}, {}{}>({}, {}, {}, r0, {}, rows, {});", m.type, rows(i.dst), cols(i.dst), pitch(i.dst),
           threads, t, m.operand, m.base, i.by_m_tile ? "m0" : "0", width(i));
    else
      line(ind, "tl::load_map<{}, {}, {}, {}, {}{}>({}, {}, {}, r0, {}, rows, {});  // load, map", m.type, map,
           rows(i.dst), cols(i.dst), pitch(i.dst), threads, t, m.operand, m.base, i.by_m_tile ? "m0" : "0", width(i));
  }

  // rowdiv of a register, and the store of it (divide_store_fusable).
  void divide_store(int ind, cuda::instruction const& store) {
    memory const m = sink(store.slot);
    line(ind, "tl::row_divide_store<{}, {}, {}, {}>({}, eps, {}, {}, r0, {}, rows, {});  // rowdiv, store", m.type,
         rows(store.dst), cols(store.dst), pitch(store.dst), name(store.dst), m.operand, m.base,
         store.by_m_tile ? "m0" : "0", width(store));
  }

  // A masked product's triangle (tl::tri_*); fused: with the mask after it in its stores.
  static char const* triangle_name(triangle x, bool fused) {
    return x == triangle::lower   ? fused ? "tl::tri_causal" : "tl::tri_lower"
           : x == triangle::upper ? fused ? "tl::tri_anticausal" : "tl::tri_upper"
                                  : "tl::tri_none";
  }

  // Two products into one fp32 register, the second adding to the first's
  // results and reading neither that register nor a triangle of it: one
  // tl::product2, which sums both in the warps' registers (same order).
  bool sum_fusable(cuda::instruction const& x, cuda::instruction const& y) const {
    auto plain = [](cuda::instruction const& i) { return i.op == opcode::product && i.tri_t == triangle::none; };
    return plain(x) && plain(y) && !x.accumulate && y.accumulate && y.dst == x.dst && y.prec == x.prec &&
           y.a != x.dst && y.b != x.dst && p.registers.at(static_cast<std::size_t>(x.dst)).storage == dtype::f32;
  }
  void product2(int ind, cuda::instruction const& x, cuda::instruction const& y) {
    auto operands = [&](cuda::instruction const& i) {
      return fmt::format("{}, {}, {}, {}, {}, {}", i.transpose_a ? rows(i.a) : cols(i.a), yes(i.transpose_a),
                         yes(i.transpose_b), pitch(i.a), pitch(i.b), triangle_name(i.tri_a, false));
    };
    auto text = [&](cuda::instruction const& i) {
      return fmt::format("{}{}·{}{}", name(i.a), i.transpose_a ? "ᵀ" : "", name(i.b), i.transpose_b ? "ᵀ" : "");
    };
    std::string const warps = p.tiles.threads != 256 ? fmt::format(", {}", p.tiles.threads / 32) : "";
    std::string const& t = name(x.dst);
    line(ind, "tl::product2<tl::{}, {}, {}, {}, {}, {}{}>({}, {}, {}, {}, {});  // {} = {} + {}", name_of(x.prec), rows(x.dst),
         cols(x.dst), pitch(x.dst), operands(x), operands(y), warps, t, name(x.a), name(x.b), name(y.a), name(y.b), t,
         text(x), text(y));
  }

  // masked: the mask after the product fused into it (masks_fusable).
  void product(int ind, cuda::instruction const& i, bool masked) {
    std::string const inner = i.transpose_a ? rows(i.a) : cols(i.a);
    // The trailing template arguments where they differ from their defaults: the triangles, then
    // the block's warps (the triangles named too, as they come first).
    bool const warps = p.tiles.threads != 256;
    std::string tris;
    if (warps || i.tri_t != triangle::none || i.tri_a != triangle::none)
      tris = fmt::format(", {}, {}", triangle_name(i.tri_t, masked), triangle_name(i.tri_a, false));
    if (warps) tris += fmt::format(", {}", p.tiles.threads / 32);
    std::string const& t = name(i.dst);
    line(ind, "tl::product<tl::{}, {}, {}, {}, {}, {}, {}, {}, {}, {}{}>({}, {}, {});  // {} {} {}{}·{}{}{}", name_of(i.prec),
         rows(i.dst), cols(i.dst), inner, yes(i.transpose_a), yes(i.transpose_b), yes(i.accumulate), pitch(i.dst),
         pitch(i.a), pitch(i.b), tris, t, name(i.a), name(i.b), t, i.accumulate ? "+=" : "=", name(i.a),
         i.transpose_a ? "ᵀ" : "", name(i.b), i.transpose_b ? "ᵀ" : "",
         !masked ? "" : i.tri_t == triangle::lower ? ", masked causally" : ", masked anticausally");
  }

  void instruction(int ind, cuda::instruction const& i) {
    if (i.op == opcode::prefetch) {  // the next chunk's rows (r_next, rows_next: the loop's); no register
      memory const m = source(i.slot);
      line(ind, "tl::prefetch<{}>({}, {}, r_next, {}, rows_next, {});  // the next chunk's rows, to L2", m.type, m.operand,
           m.base, i.by_m_tile ? "m0" : "0", width(i));
      return;
    }
    std::string const& t = name(i.dst);
    switch (i.op) {
      case opcode::zero: line(ind, "tl::zero<{}, {}, {}>({});", rows(i.dst), cols(i.dst), pitch(i.dst), t); break;
      case opcode::load: load(ind, i, {}); break;
      case opcode::map:
        if (i.b >= 0)  // parametric: from x and z = x·W; s = D^−¼ (the instruction's), 1/√F as fp32 constants
          line(ind, "tl::map_param<{}, {}, {}, {}, {}, {}, {}, {}>({}, {}, {}, {:#.9g}f, {:#.9g}f, rows);", map_tag(i.map),
               rows(i.dst), cols(i.dst), pitch(i.dst), cols(i.a), pitch(i.a), cols(i.b), pitch(i.b), t, name(i.a), name(i.b),
               i.scale, 1.0f / std::sqrt(static_cast<float>(p.registers.at(static_cast<std::size_t>(i.b)).cols)));
        else if (i.a >= 0)
          line(ind, "tl::map_rows<{}, {}, {}, {}, {}, {}>({}, {}, rows);", map_tag(i.map), rows(i.dst), cols(i.dst),
               pitch(i.dst), cols(i.a), pitch(i.a), t, name(i.a));
        else
          line(ind, "tl::map<{}, {}, {}, {}>({}, rows);", map_tag(i.map), rows(i.dst), cols(i.dst), pitch(i.dst), t);
        break;
      case opcode::ones_column:
        line(ind, "tl::ones_column<{}, {}, {}>({}, rows);", rows(i.dst), cols(i.dst), pitch(i.dst), t);
        break;
      case opcode::product: product(ind, i, false); break;
      case opcode::mask_causal:
      case opcode::mask_anticausal:
        line(ind, "tl::{}<{}, {}, {}>({}{}{});{}", name_of(i.op), rows(i.dst), cols(i.dst), pitch(i.dst), t,
             i.b >= 0 ? ", " : "", i.b >= 0 ? name(i.b) : "", i.b >= 0 ? "  // decayed" : "");
        break;
      case opcode::powers: {  // the decay's powers as lina computed them (program.hpp: decay_powers)
        // (a row per head: the host checks that the launch has as many heads)
        line(ind, "tl::powers<{}, {}, {}>({}, decay_powers{});", rows(i.dst), cols(i.dst), pitch(i.dst), t,
             per_head(p.spec) ? "[h]" : "");
        break;
      }
      case opcode::decay_rows:
        line(ind, "tl::decay_rows<{}, {}, {}, {}>({}, {}, rows);  // ·= g^{}", rows(i.dst), cols(i.dst), pitch(i.dst),
             static_cast<int>(i.power), t, name(i.b),
             i.power == decay_power::row_plus_one ? "(row + 1)" : i.power == decay_power::to_chunk_end ? "(rows − 1 − row)" : "rows");
        break;
      case opcode::row_divide:
        if (i.b >= 0)
          line(ind, "tl::row_divide<{}, {}, {}, {}>({}, eps, {});", rows(i.dst), cols(i.dst), pitch(i.dst), pitch(i.b), t,
               name(i.b));
        else
          line(ind, "tl::row_divide<{}, {}, {}>({}, eps);", rows(i.dst), cols(i.dst), pitch(i.dst), t);
        break;
      case opcode::exp_rows: {  // shift: 0 none, 1 the running max (rescaling o), 2 fixed
        int const shift = i.b < 0 ? 0 : i.a >= 0 ? 1 : 2;
        bool const biased = i.decayed;  // the bias per step of distance (program.hpp): a literal, or the head's
        line(ind, "tl::exp_rows<{}, {}, {}, {}, {}, {}, {}, {}, {}, {}{}>({}, {}, {}, {:#.9g}f, {}, args.n, keys_n{});",
             rows(i.dst), cols(i.dst), pitch(i.dst), i.a >= 0 ? cols(i.a) : "1", i.a >= 0 ? pitch(i.a) : "1",
             i.b >= 0 ? pitch(i.b) : "1", shift, yes(i.causal), yes(i.mask_scores), p.tiles.threads,
             biased ? ", true" : "", t, i.a >= 0 ? name(i.a) : "static_cast<float*>(nullptr)",
             i.b >= 0 ? name(i.b) : "static_cast<float*>(nullptr)", i.scale, scores_at(),
             !biased ? std::string() : per_head(p.spec) ? std::string(", log_decays[h]") : fmt::format(", {:#.9g}f", log_decay(p.spec)));
        break;
      }
      case opcode::square_rows:
        line(ind, "tl::square_rows<{}, {}, {}, {}>({}, {}, args.n, keys_n);", rows(i.dst), cols(i.dst), pitch(i.dst),
             yes(i.causal), t, scores_at());
        break;
      case opcode::square_grad:
        line(ind, "tl::square_grad<{}, {}, {}, {}, {}>({}, {}, {}, args.n, keys_n);", rows(i.dst), cols(i.dst), pitch(i.dst),
             pitch(i.a), yes(i.causal), t, name(i.a), scores_at());
        break;
      case opcode::exp_grad:
        line(ind, "tl::exp_grad<{}, {}, {}, {}, {}, {}>({}, {}, {:#.9g}f, {}, args.n, keys_n);", rows(i.dst), cols(i.dst),
             pitch(i.dst), pitch(i.a), yes(i.causal), yes(i.mask_scores), t, name(i.a), i.scale, scores_at());
        break;
      case opcode::store: {
        memory const m = sink(i.slot);
        if (i.whole)  // all rows of the register (∂W), once
          line(ind, "tl::store<{}, {}, {}, {}{}>({}, {}, {}, 0, 0, {}, {});{}", m.type, rows(i.dst), cols(i.dst),
               pitch(i.dst), i.accumulate ? ", true" : "", t, m.operand, m.base, rows(i.dst), width(i),
               i.accumulate ? "  // added to what is there" : "");
        else
          line(ind, "tl::store<{}, {}, {}, {}{}>({}, {}, {}, r0, {}, rows, {});{}", m.type, rows(i.dst), cols(i.dst),
               pitch(i.dst), i.accumulate ? ", true" : "", t, m.operand, m.base, i.by_m_tile ? "m0" : "0", width(i),
               i.accumulate ? "  // added to what is there" : "");
        break;
      }
      case opcode::param_grad: {
        memory const m = source(i.slot);
        line(ind, "tl::param_grad<{}, {}, {}, {}, {}, {}, {}, {}>({}, {}, {}, {}, {}, {:#.9g}f, r0, rows);", m.type,
             map_tag(i.map), rows(i.dst), cols(i.dst), pitch(i.dst), cols(i.a), pitch(i.a), pitch(i.b), t, name(i.a),
             name(i.b), m.operand, m.base, i.scale);
        break;
      }
      case opcode::map_grad: {
        if (parametric(i.map)) {  // in place on z, from ∂φ (a) and x (b)
          line(ind, "tl::map_grad_param<{}, {}, {}, {}, {}, {}, {}>({}, {}, {}, {:#.9g}f, {:#.9g}f, rows);", map_tag(i.map),
               rows(i.dst), cols(i.dst), pitch(i.dst), pitch(i.a), cols(i.b), pitch(i.b), t, name(i.a), name(i.b), i.scale,
               1.0f / std::sqrt(static_cast<float>(p.registers.at(static_cast<std::size_t>(i.dst)).cols)));
          break;
        }
        memory const m = source(i.slot);
        if (i.a >= 0)
          line(ind, "tl::map_grad_rows<{}, {}, {}, {}, {}, {}>({}, {}, {}, {}, r0, rows);", m.type, map_tag(i.map),
               rows(i.dst), cols(i.dst), pitch(i.dst), pitch(i.a), t, name(i.a), m.operand, m.base);
        else
          line(ind, "tl::map_grad<{}, {}, {}, {}, {}>({}, {}, {}, r0, rows);", m.type, map_tag(i.map), rows(i.dst),
               cols(i.dst), pitch(i.dst), t, m.operand, m.base);
        break;
      }
      case opcode::rowdiv_grad:
        if (i.b >= 0)  // softmax rows shifted by m
          line(ind, "tl::rowdiv_grad<{}, {}, {}, {}, {}>({}, {}, eps, rows, {});", rows(i.dst), cols(i.a), pitch(i.dst),
               pitch(i.a), pitch(i.b), t, name(i.a), name(i.b));
        else
          line(ind, "tl::rowdiv_grad<{}, {}, {}, {}>({}, {}, eps, rows);", rows(i.dst), cols(i.a), pitch(i.dst), pitch(i.a),
               t, name(i.a));
        break;
      case opcode::load_state:
        if (i.slot >= 0)  // from an extra buffer (a chained backward: ∂ of the state the block leaves)
          line(ind, "tl::load_state<{}, {}, {}, {}>({}, args.extra[{}], extra{}_base, m0, {});", rows(i.dst), cols(i.dst),
               pitch(i.dst), yes(i.z_column), t, i.slot, i.slot, width(i));
        else
          line(ind, "tl::load_state<{}, {}, {}, {}>({}, args.state_in, state_in_base, m0, {});", rows(i.dst), cols(i.dst),
               pitch(i.dst), yes(i.z_column), t, width(i));
        break;
      case opcode::store_state:
        line(ind, "tl::store_state<{}, {}, {}, {}>({}, args.state_out, state_out_base, m0, {}{});", rows(i.dst),
             cols(i.dst), pitch(i.dst), yes(i.z_column), t, width(i), i.accumulate ? ", true" : "");
        break;
      case opcode::store_partial:  // this group's sums, rows group·C … (a partials program)
        line(ind, "tl::store_state<{}, {}, {}, {}>({}, args.extra[{}], extra{}_base + group * {} * args.extra[{}].stride[2], m0, {});",
             rows(i.dst), cols(i.dst), pitch(i.dst), yes(i.z_column), t, i.slot, i.slot, rows(i.dst), i.slot, width(i));
        break;
      case opcode::add_partials:  // the sums of the groups before this one (non-causal: of every group of K's rows;
                                  // later: of the groups after it)
        if (i.b >= 0) {  // decayed (causal, split): Horner's rule, the last group of its own rows
          line(ind,
               "tl::add_partials_decayed<{}, {}, {}, {}, {}, chunk>({}, args.extra[{}], extra{}_base, {} * args.extra[{}].stride[2], "
               "{}, m0, {}, {}, args.group_rows, args.n - (groups - 1) * args.group_rows);  // by Horner's rule",
               rows(i.dst), cols(i.dst), pitch(i.dst), yes(i.z_column), yes(i.later), t, i.slot, i.slot, rows(i.dst), i.slot,
               i.later ? "group + 1, groups" : "0, group", width(i), name(i.b));
          break;
        }
        line(ind, "tl::add_partials<{}, {}, {}, {}>({}, args.extra[{}], extra{}_base, {} * args.extra[{}].stride[2], {}, m0, {});",
             rows(i.dst), cols(i.dst), pitch(i.dst), yes(i.z_column), t, i.slot, i.slot, rows(i.dst), i.slot,
             i.later         ? std::string("group + 1, groups")
             : i.causal      ? std::string("0, group")
                             : fmt::format("0, ({} + args.group_rows - 1) / args.group_rows",  // every group of its side
                                           p.extras.at(static_cast<std::size_t>(i.slot)).keys ? "keys_n" : "args.n"),
             width(i));
        break;
      case opcode::prefetch: break;  // (above: it names no register)
    }
  }

  // ---- barriers ------------------------------------------------------------
  // The tile operations do not wait for the block (tiles.cuh); the kernel
  // waits where one operation reads or writes what an earlier one since the
  // last barrier wrote, or writes what it read — threads own different
  // elements in different operations. What an instruction touches: its
  // registers, and `global`, all memory the kernel writes (out, the extra
  // buffers, the states: one resource, since two of them may be the same
  // memory — an input read twice has one gradient). Inputs are only read.
  static constexpr int global = -2;
  struct touched {
    std::set<int> reads, writes;
    bool operator==(touched const&) const = default;
  };
  static void add_access(cuda::instruction const& i, touched& x) {
    auto r = [&](int v) {
      if (v >= 0 || v == global) x.reads.insert(v);
    };
    auto w = [&](int v) {
      if (v >= 0 || v == global) x.writes.insert(v);
    };
    switch (i.op) {
      case opcode::prefetch: break;  // a hint: touches no tile and writes nothing
      case opcode::zero:
      case opcode::powers:
      case opcode::load_state:
      case opcode::ones_column: w(i.dst); break;
      case opcode::load:
        w(i.dst);
        if (i.accumulate) r(i.dst);
        break;
      case opcode::product:
      case opcode::param_grad:
        w(i.dst);
        if (i.accumulate) r(i.dst);
        break;
      case opcode::store:
      case opcode::store_state:
      case opcode::store_partial:
        r(i.dst);
        w(global);
        r(global);  // (an adding store reads what is there)
        break;
      case opcode::exp_rows:  // rescales o (a) and updates the running max m (b)
        r(i.dst), w(i.dst), w(i.a), w(i.b);
        break;
      default: r(i.dst), w(i.dst); break;  // in place
    }
    r(i.a), r(i.b);
    bool const reads_written = i.op == opcode::load_state || i.op == opcode::add_partials ||
                               ((i.op == opcode::load || i.op == opcode::map_grad || i.op == opcode::param_grad) &&
                                i.slot >= max_inputs);
    if (reads_written) r(global);  // an extra buffer or a state (written by this kernel's stores, perhaps)
  }
  static bool conflict(touched const& before, touched const& next) {
    auto meets = [](std::set<int> const& x, std::set<int> const& y) {
      return std::any_of(x.begin(), x.end(), [&](int v) { return y.count(v) > 0; });
    };
    return meets(before.writes, next.reads) || meets(before.writes, next.writes) || meets(before.reads, next.writes);
  }
  static void merge(touched& into, touched const& x) {
    into.reads.insert(x.reads.begin(), x.reads.end());
    into.writes.insert(x.writes.begin(), x.writes.end());
  }
  touched since;  // what ran since the last barrier
  // Before an operation that touches x: the barrier it needs, if any (printed when ind ≥ 0).
  void wait_for(int ind, touched const& x) {
    if (conflict(since, x)) {
      if (ind >= 0) line(ind, "__syncthreads();");
      since = {};
    }
    merge(since, x);
  }

  // The instructions the emitted operation at list[n] covers: 2 where a pair
  // is fused — a load and the element-wise map after it (tl::load_map), two
  // products summed into one register (tl::product2), a product and its mask,
  // rowdiv and the store after it (tl::row_divide_store).
  static std::size_t fused_at(emitter const& e, std::vector<cuda::instruction> const& list, std::size_t n) {
    if (n + 1 >= list.size()) return 1;
    cuda::instruction const &x = list[n], &y = list[n + 1];
    return fusable(x, y) || e.sum_fusable(x, y) || masks_fusable(x, y) || divide_store_fusable(x, y) ? 2 : 1;
  }
  // A list of instructions (a pass's body, a quadratic program's own rows),
  // fused and with its barriers; ind < 0 only finds the barriers.
  void body(int ind, std::vector<cuda::instruction> const& list) {
    for (std::size_t n = 0; n < list.size();) {
      std::size_t const c = fused_at(*this, list, n);
      touched x;
      for (std::size_t k = n; k < n + c; ++k) add_access(list[k], x);
      wait_for(ind, x);
      if (ind < 0) {
      } else if (c == 1) {
        instruction(ind, list[n]);
      } else if (fusable(list[n], list[n + 1])) {
        load(ind, list[n], map_tag(list[n + 1].map));
      } else if (sum_fusable(list[n], list[n + 1])) {
        product2(ind, list[n], list[n + 1]);
      } else if (divide_store_fusable(list[n], list[n + 1])) {
        divide_store(ind, list[n + 1]);
      } else {
        product(ind, list[n], true);
      }
      n += c;
    }
  }
  // One instruction outside a chunk loop (a prologue's, an epilogue's), after its barrier.
  void single(int ind, cuda::instruction const& i) {
    touched x;
    add_access(i, x);
    wait_for(ind, x);
    instruction(ind, i);
  }
  // A pass's chunk loop: its first chunk follows what ran before the loop,
  // every later one the end of the chunk before. The body starts from a set
  // that holds both: grown by what the body leaves pending from it until that
  // adds nothing (it only grows, so this ends). After the loop, what follows
  // meets either.
  void loop_body(int ind, std::vector<cuda::instruction> const& list) {
    touched start = since;
    for (;;) {
      since = start;
      body(-1, list);
      touched grown = start;
      merge(grown, since);
      if (grown == start) break;
      start = grown;
    }
    since = start;
    body(ind, list);
    merge(since, start);
  }

  std::vector<bool> used;  // registers some instruction names; the others are not declared (NVRTC would warn)

  std::string run() {
    used.assign(p.registers.size(), false);
    auto mark = [&](std::vector<cuda::instruction> const& is) {
      for (auto const& i : is)
        for (int r : {i.dst, i.a, i.b})
          if (r >= 0) used.at(static_cast<std::size_t>(r)) = true;
    };
    mark(p.prologue);
    for (auto const& pass : p.passes) mark(pass), mark(pass.before);
    mark(p.epilogue);
    // Every instruction, wherever it runs (prologue, passes, epilogue).
    std::vector<cuda::instruction const*> all;
    for_each_instruction(p, [&](cuda::instruction const& i) { all.push_back(&i); });
    float eps = 0;
    bool divides = false;
    for (auto const* i : all)
      if (i->op == opcode::row_divide || i->op == opcode::rowdiv_grad) eps = i->eps, divides = true;
    line(0, "// Generated by lina (backends/cuda/src/emit.cpp); do not edit.");
    line(0, "// {}", p.description);
    line(0, "// D = {}, M = {}; chunk T = {}, {} columns of M per block ({} block(s) per (batch, head)), {} threads;",
         p.spec.d, p.spec.m, p.tiles.chunk, p.tiles.tile_m, p.m_tiles, p.tiles.threads);
    line(0, "// inputs {}, output {}, fp32 accumulation{}, products {}; {} bytes of dynamic shared memory.",
         name_of(p.spec.in), name_of(p.spec.out), p.quadratic ? "" : " and state",
         name_of(precision_of(p.spec)), p.shared_bytes());
    line(0, "#include \"{}\"", tiles_header_name);
    line(0, "");
    line(0, "namespace {{");
    line(0, "namespace tl = lina::tile;");
    line(0, "using in_type = tl::{};", element_tag(p.spec.in));
    line(0, "using out_type = tl::{};", element_tag(p.spec.out));
    for (feature_map m : {feature_map::user0, feature_map::user1}) {  // user-defined maps: the formulas read
      bool apply = false, derivative = false;
      for (auto const* i : all) {
        apply = apply || (i->op == opcode::map && i->map == m);
        derivative = derivative || (i->op == opcode::map_grad && i->map == m);
      }
      if (!apply && !derivative) continue;
      user_map const& u = user_of(p.spec, m);
      line(0, "struct {} {{  // φ = {} (user-defined)", map_tag(m), u.name);
      if (apply) line(2, "__device__ static float apply(float x) {{ return {}; }}", u.cuda_apply);
      if (derivative) line(2, "__device__ static float derivative(float x) {{ return {}; }}", u.cuda_derivative);
      line(0, "}};");
    }
    if (!p.passes.empty() || p.quadratic)  // (a program without passes walks no chunks: a split ∂W's sum)
      line(0, "constexpr int chunk = {};", p.tiles.chunk);
    bool by_m = p.spec.chained;  // load_state and store_state always start at m0
    for (auto const* i : all) by_m = by_m || i->by_m_tile;
    if (by_m) line(0, "constexpr int tile_m = {};", p.tiles.tile_m);
    line(0, "constexpr int m_tiles = {};", p.m_tiles);
    if (divides) line(0, "constexpr float eps = {:#.9g}f;  // of rowdiv", eps);
    // The decay's tables in device memory, not in the kernel's body: a table indexed at
    // run time (by k, by the head) would be each thread's copy in local memory (ptxas
    // made 24960 bytes of stack of RetNet's 96 heads' powers at T = 64).
    auto literals = [](std::vector<float> const& xs) {  // "x0f, x1f, …", each float exactly
      return fmt::format("{:#.9g}f", fmt::join(xs, "f, "));
    };
    for (auto const* i : all)
      if (i->op == opcode::powers) {
        int const count = p.registers.at(static_cast<std::size_t>(i->dst)).cols;
        auto values_of = [&](std::int64_t head) { return literals(decay_powers(p.spec, count, head)); };
        if (per_head(p.spec)) {
          line(0, "__device__ const float decay_powers[{}][{}] = {{  // g^0 … g^{} of each head's g", p.spec.head_decays.size(),
               count, count - 1);
          for (std::size_t h = 0; h < p.spec.head_decays.size(); ++h)
            line(2, "{{{}}},  // g = {}", values_of(static_cast<std::int64_t>(h)), p.spec.head_decays[h]);
          line(0, "}};");
        } else {
          line(0, "__device__ const float decay_powers[] = {{{}}};  // g^0 … g^{}, g = {}", values_of(0), count - 1, p.spec.decay);
        }
        break;
      }
    bool biased_exp = false;
    for (auto const* i : all) biased_exp = biased_exp || (i->op == opcode::exp_rows && i->decayed);
    if (biased_exp && per_head(p.spec)) {  // (one decay: a literal in the call)
      std::vector<float> ln_g(p.spec.head_decays.size());
      for (std::size_t x = 0; x < ln_g.size(); ++x) ln_g[x] = log_decay(p.spec, static_cast<std::int64_t>(x));
      line(0, "__constant__ float log_decays[] = {{{}}};  // ln g of each head: exp_rows' bias per step of distance",
           literals(ln_g));
    }
    for (std::size_t n = 0; n < p.registers.size(); ++n) {
      auto const& r = p.registers[n];
      if (used[n])
        line(0, "constexpr int {}_rows = {}, {}_cols = {}, {}_pitch = {};  // {}", r.name, r.rows, r.name, r.cols, r.name,
             r.pitch(), r.comment);
    }
    line(0, "}}  // namespace");
    line(0, "");
    // A decoding step is latency-bound (a token per block: the state read and
    // written once), and resident blocks are its loads in flight: it asks
    // ptxas for three per SM where its shared memory allows them (sm_90's per
    // SM, less each block's reserve: program.hpp). At D = 128: 79 registers and
    // no spills; unbounded it took 112 (two blocks); four would spill.
    bool const three =
        p.spec.step && 3 * (p.shared_bytes() + shared_bytes_reserved_per_block) <= sm90_shared_bytes_per_sm;
    line(0, "extern \"C\" __global__ void __launch_bounds__({}{}) {}(const tl::forward_args args) {{", p.tiles.threads,
         three ? ", 3" : "", p.kernel_name);
    line(2, "extern __shared__ __align__(16) unsigned char shared[];");
    for (std::size_t r = 0; r < p.registers.size(); ++r) {
      if (!used[r]) continue;
      // fp32 registers as float, bf16 ones as their bit patterns (tl::bf16_bits)
      std::string_view type = p.registers[r].storage == dtype::f32 ? "float" : "tl::bf16_bits";
      line(2, "{}* const {} = reinterpret_cast<{}*>(shared + {});", type, p.registers[r].name, type,
           p.offset_of(static_cast<int>(r)));
    }
    bool walks_keys = p.quadratic || (p.split && !p.spec.causal);  // K's and V's rows, which may not be Q's
    for (auto const& pass : p.passes) walks_keys = walks_keys || pass.keys;
    for (auto const* i : all)  // (a non-causal sum over every group of K's rows: add_partials below)
      walks_keys = walks_keys || (i->op == opcode::add_partials && !i->causal && !i->later &&
                                  p.extras.at(static_cast<std::size_t>(i->slot)).keys);
    // A packable program (packable: one block per sequence, head and M tile)
    // reads its sequence's rows from row_offsets when packed (n below), so its
    // rows of K and V follow b, h.
    bool const packs = packable(p);
    std::string_view const n_rows = packs ? "n" : "args.n";
    if (walks_keys && !packs) line(2, "const long long keys_n = args.n_keys < 0 ? args.n : args.n_keys;  // rows of K and V");
    if (p.split) {  // blocks per group of rows too: x = (slice · m_tiles + m_tile) · groups + group
      std::string_view const n = p.key_major ? "keys_n" : "args.n";  // (key-major: groups of K's rows)
      line(2, "const long long groups = ({} + args.group_rows - 1) / args.group_rows;", n);
      line(2, "const long long group = blockIdx.x % groups, tile = blockIdx.x / groups;");
      // Nobody reads a causal program's last group's sums (a suffix's: the
      // first's): a block that stores nothing else returns at once.
      bool stores = false;
      for (auto const* i : all) stores = stores || i->op == opcode::store || i->op == opcode::store_state;
      for (auto const& i : p.epilogue)
        if (i.op == opcode::store_partial && !stores && (i.later || i.causal))
          line(2, "if (group == {}) return;  // nobody reads this group's sums", i.later ? "0" : "groups - 1");
      line(2, "const long long row_begin = group * args.group_rows;");
      line(2, "const long long row_end = {} - row_begin < args.group_rows ? {} : row_begin + args.group_rows;", n, n);
    }
    if (p.quadratic && p.key_major) {  // blocks per chunk of key rows too: x = (slice · m_tiles + m_tile) · k_chunks + kc
      line(2, "const long long k_chunks = (keys_n + chunk - 1) / chunk;");
      line(2, "const long long tile = blockIdx.x / k_chunks;");
      line(2, "const long long key0 = blockIdx.x % k_chunks * chunk;  // this block's key rows: key0 … + keys");
      line(2, "const int keys = static_cast<int>(keys_n - key0 < chunk ? keys_n - key0 : chunk);");
      line(2, "const long long queries_begin = {};  // the queries that read its keys", p.spec.causal ? "key0" : "0");
    } else if (p.quadratic) {  // blocks per chunk of query rows too: x = (slice · m_tiles + m_tile) · q_chunks + qc
      line(2, "const long long q_chunks = (args.n + chunk - 1) / chunk;");
      line(2, "const long long tile = blockIdx.x / q_chunks;");
      line(2, "const long long query0 = blockIdx.x % q_chunks * chunk;  // this block's query rows: query0 … + queries");
      line(2, "const int queries = static_cast<int>(args.n - query0 < chunk ? args.n - query0 : chunk);");
      line(2, "const long long keys_end = {};  // the keys its rows read", p.spec.causal ? "query0 + queries" : "keys_n");
    }
    std::string_view const tile = p.split || p.quadratic ? "tile" : "blockIdx.x";
    line(2, "const long long slice = {} / m_tiles;  // (batch, head)", tile);
    if (by_m)
      line(2, "const long long m0 = static_cast<long long>({} % m_tiles) * tile_m;  // this block's first column of M", tile);
    line(2, "const long long b = slice / args.heads, h = slice % args.heads;");
    if (packs) {  // packed sequences: b is a sequence of the operands' one batch row (the state's row b)
      line(2, "const long long row0 = args.row_offsets ? args.row_offsets[b] : 0;  // its first row");
      line(2, "const long long n = args.row_offsets ? args.row_offsets[b + 1] - row0 : args.n;  // its rows");
      line(2, "const long long rows_b = args.row_offsets ? 0 : b;  // its operands' batch row");
      if (walks_keys) line(2, "const long long keys_n = args.n_keys < 0 ? n : args.n_keys;  // rows of K and V");
    }
    // An operand's (b, h) slice: of rows indexed by N, from the sequence's first row when packed.
    auto slice_base = [&](std::string const& o, bool sequence_rows) {
      if (!packs) return fmt::format("b * {}.stride[0] + h * {}.stride[1]", o, o);
      return fmt::format("rows_b * {0}.stride[0] + {1}h * {0}.stride[1]", o, sequence_rows ? fmt::format("row0 * {}.stride[2] + ", o) : "");
    };
    std::vector<bool> loaded(p.inputs.size()), extra(p.extras.size());  // likewise memory no instruction touches
    for (auto const* i : all) {
      bool const reads =
          (i->op == opcode::load || i->op == opcode::prefetch || i->op == opcode::map_grad || i->op == opcode::param_grad) &&
          i->slot >= 0;
      if (reads && i->slot < max_inputs) loaded.at(static_cast<std::size_t>(i->slot)) = true;
      if (reads && i->slot >= max_inputs) extra.at(static_cast<std::size_t>(i->slot - max_inputs)) = true;
      if (i->op == opcode::store && i->slot >= 0) extra.at(static_cast<std::size_t>(i->slot)) = true;
      if (i->op == opcode::load_state && i->slot >= 0) extra.at(static_cast<std::size_t>(i->slot)) = true;
    }
    for (auto const* i : all)
      if (i->op == opcode::store_partial || i->op == opcode::add_partials) extra.at(static_cast<std::size_t>(i->slot)) = true;
    for (std::size_t s = 0; s < p.inputs.size(); ++s)
      if (loaded[s])
        line(2, "const long long in{}_base = {};  // {}", s, slice_base(fmt::format("args.in[{}]", s), p.inputs[s].role != "w"),
             p.inputs[s].name);
    bool stores_out = false;
    for (auto const* i : all) stores_out = stores_out || (i->op == opcode::store && i->slot < 0);
    if (stores_out)
      line(2, "const long long out_base = {};{}", slice_base("args.out", true), p.out_name == "out" ? "" : "  // " + p.out_name);
    for (std::size_t e = 0; e < p.extras.size(); ++e)
      if (extra[e])
        line(2, "const long long extra{}_base = {};  // {}", e,
             by_rows(p.extras[e]) ? slice_base(fmt::format("args.extra[{}]", e), true)
                                  : fmt::format("b * args.extra[{0}].stride[0] + h * args.extra[{0}].stride[1]", e),
             p.extras[e].name);  // (packed: ∂W and a state's gradient per sequence, as the state)
    bool state_in = false, state_out = false;  // (a chained split backward's sums launch touches neither)
    for (auto const* i : all) {
      state_in = state_in || (i->op == opcode::load_state && i->slot < 0);
      state_out = state_out || i->op == opcode::store_state;
    }
    if (state_in) line(2, "const long long state_in_base = b * args.state_in.stride[0] + h * args.state_in.stride[1];");
    if (state_out) line(2, "const long long state_out_base = b * args.state_out.stride[0] + h * args.state_out.stride[1];");
    // A quadratic program's prologue, what runs before its passes and its
    // epilogue work on the block's own rows (query rows; key-major: key rows).
    auto own_rows = [&](std::vector<cuda::instruction> const& list) {
      if (list.empty()) return;
      line(2, "{{  // this block's {} rows", p.key_major ? "key" : "query");
      line(4, "const long long r0 = {};", p.key_major ? "key0" : "query0");
      line(4, "const int rows = {};", p.key_major ? "keys" : "queries");
      body(4, list);
      line(2, "}}");
    };
    if (p.quadratic) {
      own_rows(p.prologue);
    } else {
      for (auto const& i : p.prologue) {
        if (i.op != opcode::zero && i.op != opcode::load_state && i.op != opcode::add_partials && i.op != opcode::powers &&
            !i.whole)
          throw std::logic_error(
              "lina::cuda::emit: a prologue holds only zero, load_state, add_partials, powers and whole loads (W)");
        single(2, i);
      }
    }
    for (auto const& pass : p.passes) {
      if (p.quadratic)
        own_rows(pass.before);
      else
        for (auto const& i : pass.before) {
          if (i.op != opcode::zero && i.op != opcode::load_state && i.op != opcode::add_partials)
            throw std::logic_error(
                "lina::cuda::emit: what runs before a pass is a zero, a load_state or an add_partials instruction");
          single(2, i);
        }
      if (pass.reverse && p.split)  // the group's chunks, last first (a group has rows)
        line(2, "for (long long r0 = row_begin + (row_end - row_begin - 1) / chunk * chunk; r0 >= row_begin; r0 -= chunk) {{  // last first");
      else if (pass.reverse)  // the same chunks, last first
        line(2, "for (long long r0 = {0} > 0 ? ({0} - 1) / chunk * chunk : -1; r0 >= 0; r0 -= chunk) {{  // last first", n_rows);
      else if (p.split)
        line(2, "for (long long r0 = row_begin; r0 < row_end; r0 += chunk) {{");
      else if (p.key_major)
        line(2, "for (long long r0 = queries_begin; r0 < args.n; r0 += chunk) {{  // chunks of queries");
      else if (p.quadratic)
        line(2, "for (long long r0 = 0; r0 < keys_end; r0 += chunk) {{  // chunks of keys");
      else if (pass.keys)
        line(2, "for (long long r0 = 0; r0 < keys_n; r0 += chunk) {{  // chunks of K and V");
      else
        line(2, "for (long long r0 = 0; r0 < {}; r0 += chunk) {{", n_rows);
      if (p.split)
        line(4, "const int rows = static_cast<int>(row_end - r0 < chunk ? row_end - r0 : chunk);");
      else if (p.key_major)
        line(4, "const int rows = static_cast<int>(args.n - r0 < chunk ? args.n - r0 : chunk);");
      else if (p.quadratic)
        line(4, "const int rows = static_cast<int>(keys_end - r0 < chunk ? keys_end - r0 : chunk);");
      else if (pass.keys)
        line(4, "const int rows = static_cast<int>(keys_n - r0 < chunk ? keys_n - r0 : chunk);");
      else
        line(4, "const int rows = static_cast<int>({0} - r0 < chunk ? {0} - r0 : chunk);", n_rows);
      if (std::any_of(pass.begin(), pass.end(), [](cuda::instruction const& i) { return i.op == opcode::prefetch; })) {
        // The chunk the loop visits next, and its rows (0: none).
        if (pass.reverse) {
          line(4, "const long long r_next = r0 - chunk;");
          line(4, "const int rows_next = r_next >= {} ? chunk : 0;  // (only the last chunk is short)", p.split ? "row_begin" : "0");
        } else {
          std::string_view const end = p.split ? "row_end" : p.key_major ? "args.n" : p.quadratic ? "keys_end" : pass.keys ? "keys_n" : n_rows;
          line(4, "const long long r_next = r0 + chunk;");
          line(4, "const int rows_next = static_cast<int>({} - r_next < chunk ? {} - r_next : chunk);", end, end);
        }
      }
      loop_body(4, pass);
      line(2, "}}");
    }
    if (p.quadratic) {  // the epilogue finishes and stores the block's rows
      own_rows(p.epilogue);
      line(0, "}}");
      return std::move(out);
    }
    for (auto const& i : p.epilogue) {
      bool const whole = (i.op == opcode::store || i.op == opcode::load) && i.whole;  // ∂W (a split's: += its sums)
      if (i.op != opcode::store_state && i.op != opcode::store_partial && !whole)
        throw std::logic_error(
            "lina::cuda::emit: an epilogue holds only store_state, store_partial and whole loads and stores (∂W)");
      bool const some_groups = (p.split && i.op == opcode::store_state) || (i.op == opcode::store_partial && (i.later || i.causal));
      if (!some_groups) {
        single(2, i);
        continue;
      }
      touched x;  // the barrier before the condition: every thread of the block reaches it
      add_access(i, x);
      wait_for(2, x);
      if (i.op == opcode::store_state)  // the last group's sums cover every row (later: the first's)
        line(2, "if (group == {}) {{", i.later ? "0" : "groups - 1");
      else  // (the group nobody reads)
        line(2, "if (group != {}) {{", i.later ? "0" : "groups - 1");
      instruction(4, i);
      line(2, "}}");
    }
    line(0, "}}");
    return std::move(out);
  }
};

}  // namespace

std::string emit(program const& p) { return emitter{p, {}, {}, {}}.run(); }

}  // namespace lina::cuda
