// The simt tests' main: doctest's, and in a prepare run (runner.hpp) the
// tests run quietly to record their kernels, and the exit status is that of
// compiling them.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "simt/runner.hpp"

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (!test::simt::preparing()) return context.run();
  if (test::simt::prepared()) {
    std::puts("simt: a prepare run of this binary compiled its kernels already");
    return 0;
  }
  context.setOption("out", "/dev/null");  // (its checks fail: its launches compute nothing)
  context.run();
  return test::simt::compile_recorded();
}
