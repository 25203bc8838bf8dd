// fixed_string: a string that can be a template argument, so that the names of
// dimensions and inputs live in types (dim<"N">, input<"Q">) and never in data.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace lina {

template <std::size_t N>
struct fixed_string {
  char value[N]{};
  constexpr fixed_string(const char (&s)[N]) { std::copy_n(s, N, value); }
  constexpr std::string_view view() const { return {value, N - 1}; }
  constexpr std::size_t size() const { return N - 1; }
};

template <std::size_t A, std::size_t B>
constexpr bool operator==(fixed_string<A> const& a, fixed_string<B> const& b) {
  return a.view() == b.view();
}

}  // namespace lina
