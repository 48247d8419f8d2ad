// moe_a2a._core: the C++ core as seen from Python. Raw pointers and sizes in,
// bytes and counters out; Python owns every tensor. Blocking calls release
// the GIL.
#include <nanobind/nanobind.h>

#include "a2a/wait.h"
#include "../fabric/error.h"

namespace nb = nanobind;

void bind_fabric(nb::module_& m);
void bind_a2a(nb::module_& m);
void bind_cuda(nb::module_& m);  // sets HAVE_CUDA; empty without nvcc

namespace {

// The thread that runs Python's signal handlers (threading.main_thread()).
unsigned long main_thread_ident = 0;

// wait.h's interrupt check: a wait on the main thread runs the pending
// signal handlers every kInterruptInterval, and ends with what they raise
// (Python's own SIGINT handler raises KeyboardInterrupt), which nanobind
// hands back to the caller as that exception. A handler that returns (a
// SIGTERM handler that only records it) lets the wait go on.
void check_signals() {
  if (PyThread_get_thread_ident() != main_thread_ident || !nb::is_alive()) return;
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw nb::python_error();
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "moe-a2a core: transfer engine and dispatch/combine";
  auto fabric_error = nb::exception<moe_a2a::fabric::FabricError>(m, "FabricError", PyExc_RuntimeError);
  nb::exception<moe_a2a::fabric::TimeoutError>(m, "FabricTimeoutError", fabric_error.ptr());
  bind_fabric(m);
  bind_a2a(m);
  bind_cuda(m);
  main_thread_ident = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  moe_a2a::a2a::interrupt_check.store(&check_signals, std::memory_order_release);
}
