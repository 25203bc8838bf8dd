// Derived gradients against central finite differences in double: every
// input, every element-wise map, causal or not, normalised or not, every order.
#include "gradient_support.hpp"

using namespace gradient_test;

TEST_CASE("gradients equal central differences: normalised, positive maps") {
  check_fd(causal_attn<elu_plus_one>, 1);
  check_fd(full_attn<elu_plus_one>, 2);
  check_fd(causal_attn<softplus>, 3);
  check_fd(full_attn<softplus>, 4);
}

TEST_CASE("gradients equal central differences: unnormalised, any map") {
  check_fd(causal_plain<relu>, 5);
  check_fd(full_plain<relu>, 6);
  check_fd(causal_plain<identity>, 7);
  check_fd(full_plain<identity>, 8);
  check_fd(causal_plain<elu_plus_one>, 9);
}

