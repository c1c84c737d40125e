// remat._C: the Python module whose loading registers the CUDA ops as torch.ops.remat_C.<name>, and
// holds one host-side function, same_fingerprint (guards.cpp).
//
// Each op family's .cu registers its own schemas (TORCH_LIBRARY_FRAGMENT) and CUDA kernels
// (TORCH_LIBRARY_IMPL) next to the kernels; the static registrations run when `import remat._C`
// loads this library. The fake (meta) kernels and autograd are registered from Python
// (remat/ops/*.py).

#include <Python.h>

#include <torch/library.h>

// Owns the namespace (one TORCH_LIBRARY block per namespace at most): a second definition of
// remat_C (TORCH_LIBRARY elsewhere, or torch.library.Library("remat_C", "DEF")) is refused. The
// families add their ops to it as fragments.
TORCH_LIBRARY(remat_C, m) {}

PyMethodDef* remat_guard_methods();  // guards.cpp

// Importing the module loads this library, which runs the registrations.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "remat CUDA kernels, registered as torch.ops.remat_C.*; same_fingerprint, remat._guards' fast path",
      -1,
      remat_guard_methods(),
  };
  return PyModule_Create(&module);
}
