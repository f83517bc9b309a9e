#pragma once

// Scratch memory, every estimate in one place: how much a call will allocate (the public
// score_buffer_bytes is defined in memory.cpp too; the decode path counts its own from its plan,
// cpu::flash_decode_scratch_bytes), how much the machine has, and the check that refuses a call
// that cannot fit before anything is allocated or written.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail {

// Bytes the process may use at most: physical memory, lowered by a cgroup memory limit when
// one is set. Read once.
std::int64_t memory_limit_bytes();

// An upper estimate of the scratch bytes that `impl` allocates for `params`, all threads
// together; saturates at INT64_MAX instead of overflowing.
std::int64_t scratch_bytes(AttentionImpl impl, const AttentionParams& params);

// The same for the backward pass of `impl`.
std::int64_t backward_scratch_bytes(AttentionImpl impl, const BackwardParams& params);

// Raises Error (prefixed by `caller`) when `needed` bytes exceed memory_limit_bytes.
void check_scratch_fits(const char* caller, AttentionImpl impl, const AttentionParams& params,
                        std::int64_t needed);

}  // namespace flashattn::detail
