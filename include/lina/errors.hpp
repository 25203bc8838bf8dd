// Run-time errors of lina. Static errors are static_asserts next to the code
// they guard; what is only known at run time (extents of bound tensors) throws.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace lina {

// A bound tensor's extent disagrees with the expression or with another input.
// `symbol` is the input (or "dout"), `dimension` the dimension's name
// (or "B"/"H" for batch and heads), then the offending and the expected extent.
class shape_error : public std::invalid_argument {
 public:
  shape_error(std::string symbol, std::string dimension, std::size_t got, std::size_t expected,
              std::string expected_from)
      : std::invalid_argument(compose(symbol, dimension, got, expected, expected_from)),
        symbol_(std::move(symbol)),
        dimension_(std::move(dimension)),
        got_(got),
        expected_(expected) {}

  std::string const& symbol() const noexcept { return symbol_; }
  std::string const& dimension() const noexcept { return dimension_; }
  std::size_t extent() const noexcept { return got_; }
  std::size_t expected_extent() const noexcept { return expected_; }

 private:
  static std::string compose(std::string const& symbol, std::string const& dimension, std::size_t got,
                             std::size_t expected, std::string const& from) {
    return "lina::shape_error: input " + symbol + ", dimension " + dimension + ": extent " +
           std::to_string(got) + " does not match extent " + std::to_string(expected) + " " + from;
  }
  std::string symbol_, dimension_;
  std::size_t got_, expected_;
};

// A recurrent state used with a plan it does not belong to (made by another
// plan, or for another batch or number of heads).
class state_error : public std::invalid_argument {
 public:
  explicit state_error(std::string const& what) : std::invalid_argument("lina::state_error: " + what) {}
};

// A backward given a tape (cpu::tape) that holds no forward's values, or the
// values of another plan's forward.
class tape_error : public std::invalid_argument {
 public:
  explicit tape_error(std::string const& what) : std::invalid_argument("lina::tape_error: " + what) {}
};

// Two outputs of one call (gradient views) in memory they may share: each
// would overwrite the other. `what` names both.
class alias_error : public std::invalid_argument {
 public:
  explicit alias_error(std::string const& what) : std::invalid_argument("lina::alias_error: " + what) {}
};

}  // namespace lina
