#pragma once

// The FlashAttention forward for decoding, a few query rows per KV head (flash_decode.cpp):
// flash_forward takes it where use_flash_decode says so.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail::cpu {

bool use_flash_decode(const AttentionParams& params);
void flash_decode(const AttentionParams& params);
// The scratch bytes flash_decode allocates at most, all threads together (from its plan).
std::int64_t flash_decode_scratch_bytes(const AttentionParams& params);

}  // namespace flashattn::detail::cpu
