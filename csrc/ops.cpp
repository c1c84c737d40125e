// remat._C: operator schemas (namespace remat_C) and their CUDA bindings.
//
// Loading the module (`import remat._C`) runs the static TORCH_LIBRARY registrations below;
// the ops are then torch.ops.remat_C.<name>. The fake (meta) kernels and autograd are
// registered from Python (remat/ops/*.py). One block per op family.

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "gelu.h"
#include "layer_norm.h"

// ------------------------------------------------------------------------------- schemas ----
TORCH_LIBRARY(remat_C, m) {
  // LayerNorm (csrc/layer_norm.cu)
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
      "bool recompute_output) -> (Tensor, Tensor, Tensor, Tensor)");

  // GELU (csrc/gelu.cu)
  m.def("gelu_fwd(Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def(
      "gelu_bwd(Tensor dy, Tensor x, Tensor? bias, str approximate, bool recompute_output) "
      "-> (Tensor, Tensor, Tensor)");
}

// ------------------------------------------------------------------------- CUDA kernels ----
TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  // LayerNorm
  m.impl("layer_norm_fwd", &remat::layer_norm_fwd);
  m.impl("layer_norm_bwd", &remat::layer_norm_bwd);

  // GELU
  m.impl("gelu_fwd", &remat::gelu_fwd);
  m.impl("gelu_bwd", &remat::gelu_bwd);
}

// ---------------------------------------------------------------------- Python module ----
// An empty module: importing it loads this library, which registers the ops above.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "remat CUDA kernels, registered as torch.ops.remat_C.*",
      -1,
      nullptr,
  };
  return PyModule_Create(&module);
}
