// moe_a2a._core: the C++ core as seen from Python. Raw pointers and sizes in,
// bytes and counters out; Python owns every tensor. Blocking calls release
// the GIL.
#include <nanobind/nanobind.h>

#include "../fabric/error.h"

namespace nb = nanobind;

void bind_fabric(nb::module_& m);
void bind_a2a(nb::module_& m);
void bind_cuda(nb::module_& m);  // sets HAVE_CUDA; empty without nvcc

NB_MODULE(_core, m) {
  m.doc() = "moe-a2a core: transfer engine and dispatch/combine";
  auto fabric_error = nb::exception<moe_a2a::fabric::FabricError>(m, "FabricError", PyExc_RuntimeError);
  nb::exception<moe_a2a::fabric::TimeoutError>(m, "FabricTimeoutError", fabric_error.ptr());
  bind_fabric(m);
  bind_a2a(m);
  bind_cuda(m);
}
