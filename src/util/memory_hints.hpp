#pragma once

// Memory hints of the row loops: prefetching rows that lie a page or more apart, and
// non-temporal (streaming) stores for outputs too large to stay in cache.

#include <cstdint>

#include "flashattn/dtype.hpp"

namespace flashattn::detail {

// dst[0, n) = src[0, n) with non-temporal stores (whole vectors where dst is vector-aligned, 16
// bytes at the row's ends where it is 16-byte aligned): the lines go to memory without being
// read first. For outputs too large to stay in cache; the writing thread
// calls fence_streams() before another thread may read them.
void stream_row_f32(float* dst, const float* src, std::int64_t n);
// dst[0, n) = bf16_from_f32(src[0, n)) with non-temporal stores of 16 bytes where dst is 16-byte
// aligned (on SIMD targets with 8 float lanes or more), plain stores before and after.
void stream_row_bf16(std::uint16_t* dst, const float* src, std::int64_t n);
void fence_streams();

// Rows of one head lie a sequence stride apart (H·D elements in [B, S, H, D]), usually 4 KiB
// or more, and the hardware prefetchers do not follow a stream across 4 KiB pages: each row's
// first line waited for memory. Loops over rows ask for the row kRowsAhead rows on while
// handling one, so that those waits overlap.
inline constexpr std::int64_t kRowsAhead = 8;

// One cache line into the caches (prefetcht0). An asm statement rather than
// __builtin_prefetch: GCC 12 takes a function whose only effects are __builtin_prefetch calls
// for one without side effects and deletes its calls, as it did to the whole of the decode
// path's prefetching (docs/tuning.md); a volatile asm statement is never deleted.
inline void prefetch_line(const char* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*address));
#else
  __builtin_prefetch(address);
#endif
}

// The same into L2 (prefetcht1): the decode's rows ahead on AMD's cores other than Zen 5, faster
// there than into L1 (docs/tuning.md); and the one or the other.
inline void prefetch_line_into_l2(const char* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*address));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}
inline void prefetch_line(const char* address, bool into_l2) {
  if (into_l2) {
    prefetch_line_into_l2(address);
  } else {
    prefetch_line(address);
  }
}

// Asks for the n elements at base + offset to be brought into the caches, for reading or (a
// row the caller will write) for writing; returns at once. Inline: it is called once per row
// (docs/tuning.md). Both are prefetcht0: a line that no other core holds arrives exclusive, and
// the store that follows needs no further request (prefetchw would need -mprfchw).
inline void prefetch_row(const void* base, DType dtype, std::int64_t offset, std::int64_t n,
                         [[maybe_unused]] bool for_write = false) {
  constexpr std::int64_t kLineBytes = 64;
  const std::int64_t element_bytes = static_cast<std::int64_t>(dtype_size(dtype));
  const char* first = static_cast<const char*>(base) + offset * element_bytes;
  for (std::int64_t byte = 0; byte < n * element_bytes; byte += kLineBytes) {
    prefetch_line(first + byte);
  }
  prefetch_line(first + n * element_bytes - 1);
}

// Whether store_row_f32(..., stream) writes with non-temporal stores: f32 and bf16 rows.
inline bool streams_rows(DType dtype, bool stream) {
  return stream && (dtype == DType::f32 || dtype == DType::bf16);
}

// Asks for the row that store_row_f32(dst, dtype, offset, ..., n, stream) (util/convert.hpp) will
// write, unless that streams it: plain stores read every line they write (write-allocate), and rows
// lie a page or more apart, so callers ask kRowsAhead rows on, as for loads (docs/tuning.md). A
// streamed row is read by none of its stores (stream_row_f32 writes even its partial end lines
// non-temporally where it can).
inline void prefetch_store_row(void* dst, DType dtype, std::int64_t offset, std::int64_t n,
                               bool stream) {
  if (!streams_rows(dtype, stream)) prefetch_row(dst, dtype, offset, n, true);
}

}  // namespace flashattn::detail
