#include <nanobind/nanobind.h>

namespace nb = nanobind;

void bind_a2a(nb::module_& m) { (void)m; }
