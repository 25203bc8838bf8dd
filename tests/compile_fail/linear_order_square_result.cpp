// An N x N result cannot be computed without an N x N matrix.
// expect: no evaluation order avoids an N x N matrix
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto plan = compile<order::linear>(causal(Q * transpose(K)));
#else
  auto plan = compile<order::linear>(causal(Q * transpose(K)) * V);
#endif
  (void)plan;
}
