#pragma once

// A file that appears whole or not at all: written under a hidden temporary name next to its
// destination and renamed over it on commit(), so that a failed or interrupted run never leaves
// a partial output behind. A process stopped by SIGINT, SIGTERM or SIGHUP removes its temporary
// files on the way out (a handler installed with the first file).

#include <cstddef>
#include <filesystem>
#include <string_view>

namespace flashattn::cli {

class AtomicFile {
 public:
  // Creates the temporary file, so that an unwritable destination fails (flashattn::Error naming
  // `path`) before any work is done.
  explicit AtomicFile(std::filesystem::path path);
  // Removes the temporary file unless commit() succeeded.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends bytes to the temporary file; on failure discards it and throws.
  void append(const void* data, std::size_t size);
  void append(std::string_view text) { append(text.data(), text.size()); }
  // Closes the temporary file and renames it to path(); on failure discards it and throws.
  void commit();
  // Closes and removes the temporary file; path() is left untouched.
  void discard() noexcept;

  // Whether append() and commit() may still be called.
  bool is_open() const { return fd_ >= 0; }
  const std::filesystem::path& path() const { return path_; }
  // Where the content is until commit(): for a program that writes the file by name itself.
  const std::filesystem::path& temp_path() const { return temp_path_; }

 private:
  [[noreturn]] void fail_with_errno(int error);

  std::filesystem::path path_;
  std::filesystem::path temp_path_;
  int fd_ = -1;
  bool committed_ = false;
  int pending_slot_ = -1;  // where a signal handler finds temp_path_ to remove it
};

}  // namespace flashattn::cli
