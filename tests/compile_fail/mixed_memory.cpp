// A host tensor and another backend's tensor bound in one evaluation.
// expect: must live in the same kind of memory
// errors: 1
#include "_prelude.hpp"
namespace elsewhere {
struct remote_view {
  using element_type_ = float const;
  float const* ptr = nullptr;
  shape4 dims{1, 1, 4, 16};
  strides4 steps{64, 64, 16, 1};
  float const* data() const { return ptr; }
  shape4 const& shape() const { return dims; }
  strides4 const& strides() const { return steps; }
};
struct remote_tensor {};
inline remote_view view_of(remote_tensor const&) { return {}; }
}  // namespace elsewhere
int main() {
  tensor<float> q({1, 1, 4, 32}), v({1, 1, 4, 16});
  elsewhere::remote_tensor remote;
#ifdef LINA_COMPILE_FAIL
  auto in = bind<decltype(compile(attn))>(Q = q, K = q, V = remote);
#else
  auto in = bind<decltype(compile(attn))>(Q = q, K = q, V = v);
#endif
  (void)in;
  (void)remote;
}
