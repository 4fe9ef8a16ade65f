// The Python module of the compiled CPU kernels: every source's functions (see bindings.h).
#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (auto bind : fastweights_cpu::binders()) bind(m);
}
