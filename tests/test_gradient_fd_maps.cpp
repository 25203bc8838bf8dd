// Derived gradients against central finite differences in double: softmax,
// scaled and repeated inputs, and the polynomial and random-feature maps
// (with the gradient of their projection W).
#include "gradient_support.hpp"

using namespace gradient_test;

TEST_CASE("gradients equal central differences: softmax, scaled, normalize as written") {
  check_fd(normalize(exp(Q * transpose(K) * 0.5)) * V, 10);
  check_fd(normalize(causal(exp(Q * transpose(K) / 3.0))) * V, 11);
  check_fd(0.25 * causal(phi<elu_plus_one>(Q) * transpose(2.0 * phi<elu_plus_one>(K))) * V, 12);
  // Q and K twice each: contributions to one input add up.
  check_fd(causal(phi<elu_plus_one>(Q) * transpose(phi<elu_plus_one>(Q))) * (K * (transpose(K) * V)), 13);
}


TEST_CASE("gradients equal central differences: poly2, favor, random Fourier features") {
  check_fd(causal_plain<poly2>, 20);
  check_fd(full_attn<poly2>, 21);  // normalised: (q·k)² >= 0
  check_fd(normalize(causal(phi<favor>(Q, W) * transpose(phi<favor>(K, W)))) * V, 22);
  check_fd(phi<favor>(Q, W) * transpose(phi<favor>(K, W)) * V, 23);
  check_fd(causal(phi<random_fourier>(Q, W) * transpose(phi<random_fourier>(K, W))) * V, 24);
}
