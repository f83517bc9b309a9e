#pragma once

#include <new>
#include <sstream>
#include <string>

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

// Runs body(): std::bad_alloc from anywhere in it (validation's own small buffers, the scratch, a
// worker thread's) becomes Error("<caller>: out of memory"), so that no entry point lets
// std::bad_alloc out (tests/fault_injection makes each allocation fail in turn). An Error with
// a more precise message, thrown inside, passes through.
template <class Body>
void out_of_memory_as_error(const char* caller, Body&& body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    throw Error(std::string(caller) + ": out of memory");
  }
}

}  // namespace flashattn::detail
