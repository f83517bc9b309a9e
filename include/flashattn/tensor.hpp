#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "flashattn/dtype.hpp"

namespace flashattn {

// A non-owning view of a 4-d tensor: data pointer, element type, dims and element strides
// (not bytes). The last dim must be contiguous (stride 1) wherever the library reads a view.
// The seed's [B, Nh, S, Dh] layout and docs/design.md's [B, S, H, D] layout are the same memory
// seen through different strides, so splitting or merging heads is a view, never a copy.
template <class Pointer>
struct BasicTensorView {
  Pointer data = nullptr;
  DType dtype = DType::f32;
  std::array<std::int64_t, 4> shape{};
  std::array<std::int64_t, 4> strides{};

  std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }

  // A mutable view reads as a const one wherever an input is expected.
  operator BasicTensorView<const void*>() const requires std::is_same_v<Pointer, void*> {
    return {data, dtype, shape, strides};
  }
};

using TensorView = BasicTensorView<void*>;
using ConstTensorView = BasicTensorView<const void*>;

// A read-only 4-d view of booleans, one byte each (C++ bool, numpy's bool, torch.bool): 0 is
// false, any other byte true. Element strides, any sign-free values.
struct MaskView {
  const bool* data = nullptr;
  std::array<std::int64_t, 4> shape{};
  std::array<std::int64_t, 4> strides{};
};

// Positions [begin, begin + count) along dim 1 (the sequence) of a view: the same memory, no copy.
// The caller keeps them within the view.
template <class Pointer>
BasicTensorView<Pointer> sequence_slice(const BasicTensorView<Pointer>& view, std::int64_t begin,
                                        std::int64_t count) {
  using Byte =
      std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const char, char>;
  BasicTensorView<Pointer> part = view;
  part.data = static_cast<Byte*>(view.data) +
              begin * view.strides[1] * static_cast<std::int64_t>(dtype_size(view.dtype));
  part.shape[1] = count;
  return part;
}

// Row-major (C order) strides for `shape`.
constexpr std::array<std::int64_t, 4> contiguous_strides(const std::array<std::int64_t, 4>& shape) {
  return {shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1};
}

inline TensorView contiguous_view(void* data, DType dtype, std::array<std::int64_t, 4> shape) {
  return {data, dtype, shape, contiguous_strides(shape)};
}
inline ConstTensorView contiguous_view(const void* data, DType dtype,
                                       std::array<std::int64_t, 4> shape) {
  return {data, dtype, shape, contiguous_strides(shape)};
}
inline TensorView contiguous_view(float* data, std::array<std::int64_t, 4> shape) {
  return contiguous_view(static_cast<void*>(data), DType::f32, shape);
}
inline ConstTensorView contiguous_view(const float* data, std::array<std::int64_t, 4> shape) {
  return contiguous_view(static_cast<const void*>(data), DType::f32, shape);
}

}  // namespace flashattn
