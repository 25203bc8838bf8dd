// phi<Map> with something that is not a feature map.
// expect: Map is not a feature map
// errors: 1
#include "_prelude.hpp"
struct half_a_map {
  static constexpr std::string_view name = "half";
  template <class T>
  static T value(T x) {
    return x;
  }  // no derivative: gradients would be impossible
};
int main() {
#ifdef LINA_COMPILE_FAIL
  auto e = phi<half_a_map>(Q);
#else
  auto e = phi<identity>(Q);
#endif
  (void)e;
}
