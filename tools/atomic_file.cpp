#include "atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>
#include <utility>

#include "flashattn/error.hpp"

namespace flashattn::cli {

namespace {

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& problem) {
  throw Error(path.string() + ": " + problem);
}

// The temporary files not yet committed or discarded, for a signal handler to remove: a process
// stopped by SIGINT, SIGTERM (mpirun ending a job whose rank died) or SIGHUP runs no destructor.
// Fixed slots of plain bytes, so that the handler does nothing but unlink(), which is
// async-signal-safe.
struct PendingFile {
  std::atomic<bool> used{false};
  char path[4096] = {};
};
std::array<PendingFile, 64> pending_files;

extern "C" void remove_pending_files(int signal) {
  for (PendingFile& file : pending_files) {
    if (file.used.load()) ::unlink(file.path);
  }
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

// The slot that now holds `path`, or -1 when the path is too long or every slot is taken (the
// file is then left behind by a signal, as before).
int track_pending(const std::filesystem::path& path) {
  static const bool installed = [] {
    for (int signal : {SIGINT, SIGTERM, SIGHUP}) std::signal(signal, remove_pending_files);
    return true;
  }();
  (void)installed;
  const std::string& text = path.native();
  if (text.size() >= sizeof(PendingFile::path)) return -1;
  for (std::size_t slot = 0; slot < pending_files.size(); ++slot) {
    PendingFile& file = pending_files[slot];
    if (file.used.load()) continue;
    std::memcpy(file.path, text.c_str(), text.size() + 1);
    file.used.store(true);
    return static_cast<int>(slot);
  }
  return -1;
}

void untrack_pending(int slot) {
  if (slot >= 0) pending_files[static_cast<std::size_t>(slot)].used.store(false);
}

}  // namespace

AtomicFile::AtomicFile(std::filesystem::path path) : path_(std::move(path)) {
  if (path_.filename().empty()) fail(path_, "cannot write: expected a file name");
  std::error_code error;
  if (std::filesystem::is_directory(path_, error)) fail(path_, "cannot write: is a directory");

  // A hidden name in the destination's directory, so that the final rename stays within one
  // file system and is atomic.
  static std::atomic<unsigned> counter{0};
  const std::filesystem::path directory =
      path_.has_parent_path() ? path_.parent_path() : std::filesystem::path(".");
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name(1, '.');
    name += path_.filename().string();
    name += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    temp_path_ = directory / name;
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  if (fd_ < 0) {
    const int open_error = errno;
    temp_path_.clear();
    fail(path_, std::string("cannot write: ") + std::strerror(open_error));
  }
  pending_slot_ = track_pending(temp_path_);
}

AtomicFile::~AtomicFile() {
  if (!committed_) discard();
}

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
  untrack_pending(std::exchange(pending_slot_, -1));
}

void AtomicFile::fail_with_errno(int error) {
  discard();
  fail(path_, std::string("cannot write: ") + std::strerror(error));
}

void AtomicFile::append(const void* data, std::size_t size) {
  if (fd_ < 0) fail(path_, "cannot write: the file was already committed or discarded");
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd_, bytes, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail_with_errno(errno);
    }
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

void AtomicFile::commit() {
  if (fd_ < 0) fail(path_, "cannot write: the file was already committed or discarded");
  if (::close(std::exchange(fd_, -1)) != 0) fail_with_errno(errno);
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) fail_with_errno(errno);
  temp_path_.clear();
  untrack_pending(std::exchange(pending_slot_, -1));
  committed_ = true;
}

}  // namespace flashattn::cli
