#pragma once

#include <sstream>

#include "flashattn/error.hpp"

namespace flashattn::detail {

// Throws Error("<caller>: <parts...>"): every validation message names the entry point first,
// then the argument, the expected and the given value.
template <class... Parts>
[[noreturn]] void fail(const char* caller, const Parts&... parts) {
  std::ostringstream message;
  message << caller << ": ";
  (message << ... << parts);
  throw Error(message.str());
}

}  // namespace flashattn::detail
