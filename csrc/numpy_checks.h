// Checks of the numpy arrays the bindings read through raw pointers (csrc/bindings.cpp,
// csrc/vllm_mirror.cpp): one rule per field, TypeError / ValueError naming it.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

namespace zos {

namespace py = pybind11;

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
inline constexpr char kNativeOrder = '<';
#else
inline constexpr char kNativeOrder = '>';
#endif

template <typename T>
const char* dtype_name() {
  return sizeof(T) == 8 ? "int64" : "int32";
}

// Checks that obj is a 1-D C-contiguous numpy array of T; returns it.
template <typename T>
py::array checked(const py::handle& obj, const char* field, bool writeable = false) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(field) + " must be a numpy array (use tensor.numpy()), got " +
                         std::string(py::str(py::type::of(obj))));
  auto arr = py::reinterpret_borrow<py::array>(obj);
  // Compare kind, size and byte order, not dtype identity: an unpickled array
  // has an equal dtype that is a different object.
  const auto dt = arr.dtype();
  const bool native = dt.byteorder() == '=' || dt.byteorder() == '|' ||
                      dt.byteorder() == kNativeOrder;
  if (dt.kind() != 'i' || dt.itemsize() != static_cast<py::ssize_t>(sizeof(T)) || !native)
    throw py::type_error(std::string(field) + " must have dtype " + dtype_name<T>() + ", got " +
                         std::string(py::str(arr.dtype())));
  if (arr.ndim() != 1)
    throw py::value_error(std::string(field) + " must be 1-D, got " + std::to_string(arr.ndim()) +
                          " dimensions");
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error(std::string(field) + " must be contiguous");
  if (writeable && !arr.writeable()) throw py::value_error(std::string(field) + " is read-only");
  return arr;
}

}  // namespace zos
