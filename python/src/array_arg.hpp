#pragma once

// The array arguments of the extension's functions: InArray (read) and OutArray (written).
//
// A torch CPU tensor is read through its own attributes (data_ptr(), shape, stride(), dtype),
// which costs well under a microsecond; torch's __dlpack__, which nanobind's ndarray import calls,
// is a Python method that costs ~5 us a tensor, and a call passes five or more (q, k, v, out,
// lse): more than a decode step's kernel takes on a small model. Every other array (numpy, a
// torch tensor of a dtype or device this path does not read) goes through nanobind's ndarray
// import, DLPack or the buffer protocol, as before.
//
// Both expose the accessors of nb::ndarray that the bindings use (data, dtype, ndim, shape,
// stride in elements, size), so the code that turns arrays into views takes either.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace flashattn::python {

namespace nb = nanobind;

template <bool kWritable>
class ArrayArg {
 public:
  using Imported = std::conditional_t<kWritable, nb::ndarray<nb::device::cpu>,
                                      nb::ndarray<nb::ro, nb::device::cpu>>;
  static constexpr std::size_t kMaxDims = 8;

  void* data() const { return data_; }
  nb::dlpack::dtype dtype() const { return dtype_; }
  std::size_t ndim() const { return ndim_; }
  std::size_t shape(std::size_t i) const { return static_cast<std::size_t>(shape_[i]); }
  std::int64_t stride(std::size_t i) const { return strides_[i]; }
  std::size_t size() const { return static_cast<std::size_t>(size_); }

  // A torch CPU tensor of a dtype the library reads, or false (then nothing is set).
  bool read_torch(nb::handle tensor) noexcept;
  // Any other array, through nanobind's ndarray import.
  bool read_imported(nb::handle array, std::uint8_t flags,
                     nb::detail::cleanup_list* cleanup) noexcept;

 private:
  void* data_ = nullptr;
  nb::dlpack::dtype dtype_{};
  std::size_t ndim_ = 0;
  std::array<std::int64_t, kMaxDims> shape_{}, strides_{};
  std::int64_t size_ = 0;
  std::optional<Imported> imported_;  // keeps an import alive for the call
};

using InArray = ArrayArg<false>;
using OutArray = ArrayArg<true>;

namespace detail {

// torch.Tensor and the torch dtypes this path reads, looked up once torch is imported (never by
// the extension itself); they live as long as the interpreter.
struct TorchTypes {
  PyObject* tensor = nullptr;
  struct Dtype {
    PyObject* object;
    nb::dlpack::dtype dlpack;
  };
  std::array<Dtype, 10> dtypes{};
};

inline const TorchTypes* torch_types() {
  static TorchTypes types;
  static bool found = false;
  if (found) return &types;
  PyObject* modules = PyImport_GetModuleDict();                                  // borrowed
  PyObject* torch = modules ? PyDict_GetItemString(modules, "torch") : nullptr;  // borrowed
  if (torch == nullptr) return nullptr;
  nb::handle module(torch);
  using Code = nb::dlpack::dtype_code;
  auto dtype = [](Code code, int bits) {
    return nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
  };
  const std::pair<const char*, nb::dlpack::dtype> names[] = {
      {"float32", dtype(Code::Float, 32)},   {"float16", dtype(Code::Float, 16)},
      {"bfloat16", dtype(Code::Bfloat, 16)}, {"int32", dtype(Code::Int, 32)},
      {"int64", dtype(Code::Int, 64)},       {"int16", dtype(Code::Int, 16)},
      {"uint16", dtype(Code::UInt, 16)},     {"uint8", dtype(Code::UInt, 8)},
      {"int8", dtype(Code::Int, 8)},         {"bool", dtype(Code::Bool, 8)}};
  try {
    types.tensor = module.attr("Tensor").inc_ref().ptr();
    for (std::size_t i = 0; i < types.dtypes.size(); ++i) {
      types.dtypes[i] = {module.attr(names[i].first).inc_ref().ptr(), names[i].second};
    }
  } catch (...) {
    PyErr_Clear();
    return nullptr;
  }
  found = true;
  return &types;
}

}  // namespace detail

template <bool kWritable>
bool ArrayArg<kWritable>::read_torch(nb::handle tensor) noexcept {
  const detail::TorchTypes* torch = detail::torch_types();
  if (torch == nullptr || !PyObject_TypeCheck(tensor.ptr(), (PyTypeObject*)torch->tensor)) {
    return false;
  }
  try {
    if (!nb::cast<bool>(tensor.attr("is_cpu"))) return false;
    const nb::object dtype = tensor.attr("dtype");
    const detail::TorchTypes::Dtype* found = nullptr;
    for (const auto& d : torch->dtypes) {
      if (d.object == dtype.ptr()) found = &d;
    }
    if (found == nullptr) return false;
    const nb::object shape = tensor.attr("shape"), strides = tensor.attr("stride")();
    const std::size_t ndim = nb::len(shape);
    if (ndim > kMaxDims || nb::len(strides) != ndim) return false;
    std::int64_t size = 1;
    for (std::size_t i = 0; i < ndim; ++i) {
      shape_[i] = nb::cast<std::int64_t>(shape[i]);
      strides_[i] = nb::cast<std::int64_t>(strides[i]);
      size *= shape_[i];
    }
    data_ = reinterpret_cast<void*>(nb::cast<std::uintptr_t>(tensor.attr("data_ptr")()));
    dtype_ = found->dlpack;
    ndim_ = ndim;
    size_ = size;
    return true;
  } catch (...) {
    PyErr_Clear();
    return false;
  }
}

template <bool kWritable>
bool ArrayArg<kWritable>::read_imported(nb::handle array, std::uint8_t flags,
                                        nb::detail::cleanup_list* cleanup) noexcept {
  nb::detail::make_caster<Imported> caster;
  if (!caster.from_python(array, flags, cleanup)) return false;
  const Imported& imported = imported_.emplace(caster.value);
  if (imported.ndim() > kMaxDims) return false;
  data_ = const_cast<void*>(static_cast<const void*>(imported.data()));
  dtype_ = imported.dtype();
  ndim_ = imported.ndim();
  size_ = static_cast<std::int64_t>(imported.size());
  for (std::size_t i = 0; i < ndim_; ++i) {
    shape_[i] = static_cast<std::int64_t>(imported.shape(i));
    strides_[i] = imported.stride(i);
  }
  return true;
}

}  // namespace flashattn::python

namespace nanobind::detail {

template <bool kWritable>
struct type_caster<flashattn::python::ArrayArg<kWritable>> {
  NB_TYPE_CASTER(flashattn::python::ArrayArg<kWritable>, const_name("ndarray"))

  bool from_python(handle src, uint8_t flags, cleanup_list* cleanup) noexcept {
    return value.read_torch(src) || value.read_imported(src, flags, cleanup);
  }
};

}  // namespace nanobind::detail
