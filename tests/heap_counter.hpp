// Counts the program's heap allocations (every operator new) while a
// heap_counter is alive, to prove that a code path allocates nothing.
#pragma once

#include <cstddef>

namespace test {
std::size_t heap_allocations();  // since the program started, counted only while counting
void count_heap(bool on);

struct heap_counter {
  std::size_t start;
  heap_counter() : start((count_heap(true), heap_allocations())) {}
  ~heap_counter() { count_heap(false); }
  std::size_t allocations() const { return heap_allocations() - start; }
};
}  // namespace test
