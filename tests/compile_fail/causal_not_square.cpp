// causal() of a matrix that is not N x N.
// expect: causal\(S\) masks a square similarity
// errors: 1
#include "_prelude.hpp"
int main() {
#ifdef LINA_COMPILE_FAIL
  auto e = causal(Q * transpose(phi<relu>(Q))) * causal(V);
#else
  auto e = causal(Q * transpose(phi<relu>(Q))) * V;
#endif
  (void)e;
}
