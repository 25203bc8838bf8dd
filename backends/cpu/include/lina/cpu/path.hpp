// The CPU backend's two paths: the fast one (chunked register-tiled scans,
// fused groups made inside the scans, one long sequence split across
// threads) and the simple one, kept as the fast path's oracle: every operand
// materialised in full, a plain row-by-row scan, no split. The same plans,
// bindings, states and gradients run on both; the test suite runs once on
// each (ctest's "simple:" entries, LINA_CPU_PATH=simple).
#pragma once

#include <atomic>
#include <cstdlib>
#include <string_view>

namespace lina::cpu {

enum class path { fast, simple };

namespace detail {
inline std::atomic<path>& path_setting() {
  static std::atomic<path> p{[] {
    char const* env = std::getenv("LINA_CPU_PATH");
    return env && std::string_view(env) == "simple" ? path::simple : path::fast;
  }()};
  return p;
}
}  // namespace detail

// The path evaluations started from now on take (for the whole process);
// the environment variable LINA_CPU_PATH=simple sets it at start-up.
inline void use_path(path p) { detail::path_setting().store(p); }
inline path current_path() { return detail::path_setting().load(); }

}  // namespace lina::cpu
