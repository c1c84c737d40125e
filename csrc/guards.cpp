// remat._C.same_fingerprint: the steady-state question of a converted module's guard
// (remat/_guards.py, decided), answered without building anything.
//
// A converted module keeps its verdict while a fingerprint of the modules it read is unchanged:
// remat._guards.fingerprint builds it as one flat list,
//
//   [len(global hook dict) for each of the 4,
//    then for each module that is not None:
//      module, its class, its training flag, len(_forward_hooks), len(_forward_pre_hooks),
//      len(_backward_hooks), len(_backward_pre_hooks),
//      then for each of its own parameters that is not None: id(p), its class, p.dtype, p.shape]
//
// and compares it with the kept one at every call of a converted layer (twice a layer: a few µs each,
// in Python). This walks the same modules and compares each entry with the kept list in place. It
// answers true only where every entry is the one the list holds (the same objects, lengths, dtypes
// and sizes), which is where the Python comparison answers equal; anything it does not expect (a
// parameter of another class than a plain tensor, a training flag that is not the same object, a
// module without its hook dicts) answers false, and the caller takes the fingerprint in Python.

#include <Python.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

// The entries a module and a parameter take in the list.
constexpr Py_ssize_t kModuleEntries = 7;
constexpr Py_ssize_t kParameterEntries = 4;

PyObject* interned(const char* name) { return PyUnicode_InternFromString(name); }

struct Names {
  PyObject* training = interned("training");
  PyObject* hooks[4] = {interned("_forward_hooks"), interned("_forward_pre_hooks"), interned("_backward_hooks"),
                        interned("_backward_pre_hooks")};
  PyObject* parameters = interned("_parameters");
};

const Names& names() {
  static const Names kNames;
  return kNames;
}

// Whether `dict` is a dict of `expected` (a Python int) entries.
bool has_length(PyObject* dict, PyObject* expected) {
  if (dict == nullptr || !PyDict_Check(dict) || !PyLong_Check(expected)) return false;
  return PyLong_AsSsize_t(expected) == PyDict_Size(dict);
}

// Whether the parameter `p` is what `entry` (its 4 entries) says: the same object (id), of the same class,
// a plain tensor class (`plain`: a subclass may report another dtype or shape than its storage has), with
// the same dtype and sizes.
bool same_parameter(PyObject* p, PyObject** entry, PyObject* plain) {
  if (!PyLong_Check(entry[0]) || PyLong_AsVoidPtr(entry[0]) != static_cast<void*>(p)) return false;
  PyObject* kind = reinterpret_cast<PyObject*>(Py_TYPE(p));
  if (entry[1] != kind || PySequence_Contains(plain, kind) != 1 || !THPVariable_Check(p)) return false;
  const at::Tensor& tensor = THPVariable_Unpack(p);
  if (!THPDtype_Check(entry[2]) || reinterpret_cast<THPDtype*>(entry[2])->scalar_type != tensor.scalar_type()) {
    return false;
  }
  PyObject* shape = entry[3];
  const auto sizes = tensor.sizes();
  if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(sizes.size())) return false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    PyObject* size = PyTuple_GET_ITEM(shape, d);
    if (!PyLong_Check(size) || PyLong_AsLongLong(size) != sizes[d]) return false;
  }
  return true;
}

// Whether the module `m` (its dict `state`) and its parameters are what the list holds from `*at` on;
// *at moves past them.
bool same_module(PyObject* m, PyObject* state, PyObject* key, Py_ssize_t* at, PyObject* plain) {
  const Names& n = names();
  const Py_ssize_t length = PyList_GET_SIZE(key);
  if (*at + kModuleEntries > length) return false;
  PyObject** entry = &PyList_GET_ITEM(key, *at);
  if (entry[0] != m || entry[1] != reinterpret_cast<PyObject*>(Py_TYPE(m))) return false;
  if (PyDict_GetItemWithError(state, n.training) != entry[2]) return false;
  for (int h = 0; h < 4; ++h) {
    if (!has_length(PyDict_GetItemWithError(state, n.hooks[h]), entry[3 + h])) return false;
  }
  *at += kModuleEntries;
  PyObject* parameters = PyDict_GetItemWithError(state, n.parameters);
  if (parameters == nullptr || !PyDict_Check(parameters)) return false;
  PyObject *name, *p;
  Py_ssize_t position = 0;
  while (PyDict_Next(parameters, &position, &name, &p)) {
    if (p == Py_None) continue;
    if (*at + kParameterEntries > length || !same_parameter(p, &PyList_GET_ITEM(key, *at), plain)) return false;
    *at += kParameterEntries;
  }
  return true;
}

// same_fingerprint(key, modules, global_hook_dicts, plain_tensor_types) -> bool: whether
// remat._guards.fingerprint(modules) would equal `key` (a list it built), read in place.
PyObject* same_fingerprint(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != 4) {
    PyErr_SetString(PyExc_TypeError, "same_fingerprint(key, modules, global_hook_dicts, plain_tensor_types)");
    return nullptr;
  }
  PyObject *key = args[0], *global_hooks = args[2], *plain = args[3];
  if (!PyList_Check(key) || !PyTuple_Check(global_hooks)) Py_RETURN_FALSE;
  PyObject* modules = PySequence_Fast(args[1], "same_fingerprint: modules must be a sequence");
  if (modules == nullptr) return nullptr;
  bool same = true;
  Py_ssize_t at = 0;
  const Py_ssize_t hooks = PyTuple_GET_SIZE(global_hooks);
  for (Py_ssize_t g = 0; same && g < hooks; ++g, ++at) {
    same = at < PyList_GET_SIZE(key) && has_length(PyTuple_GET_ITEM(global_hooks, g), PyList_GET_ITEM(key, at));
  }
  const Py_ssize_t module_count = PySequence_Fast_GET_SIZE(modules);
  PyObject** items = PySequence_Fast_ITEMS(modules);
  for (Py_ssize_t i = 0; same && i < module_count; ++i) {
    PyObject* m = items[i];
    if (m == Py_None) continue;
    PyObject* state = PyObject_GenericGetDict(m, nullptr);  // a new reference
    same = state != nullptr && PyDict_Check(state) && same_module(m, state, key, &at, plain);
    Py_XDECREF(state);
  }
  Py_DECREF(modules);
  PyErr_Clear();  // an entry it could not read is no error here: the caller takes the fingerprint in Python
  if (same && at == PyList_GET_SIZE(key)) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef kMethods[] = {
    {"same_fingerprint", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(same_fingerprint)),
     METH_FASTCALL, "Whether remat._guards.fingerprint(modules) equals key, compared in place."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* remat_guard_methods() { return kMethods; }
