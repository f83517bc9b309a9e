#pragma once

#include <stdexcept>
#include <string>

namespace flashattn {

// Raised for every invalid argument. The message names the argument, the expected value and
// the value given, e.g. "k: expected head_dim 64 (as q), got 32".
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

}  // namespace flashattn
