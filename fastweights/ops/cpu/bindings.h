// How each kernel source adds its functions to the one Python module of the compiled CPU kernels.
//
// A source defines its functions and, at namespace scope,
//   static fastweights_cpu::Binding bind([](pybind11::module_& m) { m.def("name", &fn, "doc"); });
// module.cpp (the only PYBIND11_MODULE) runs every registered binding when Python imports the
// library, after all static initializers have run, so the order of the sources does not matter.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace fastweights_cpu {

using Binder = void (*)(pybind11::module_&);

inline std::vector<Binder>& binders() {
  static std::vector<Binder> all;  // a function-local static: built before the first registration
  return all;
}

struct Binding {
  explicit Binding(Binder f) { binders().push_back(f); }
};

}  // namespace fastweights_cpu
