#pragma once

// Running the `flashattn` command-line tool as a subprocess, shared by the CLI tests: its exit
// code, stdout and stderr, scratch directories, the fixture that gives each test its own, the
// check of a clean failure, and the JSON line that `run` prints.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

extern char** environ;

namespace flashattn::testing {

struct Completed {
  int exit_code = -1;
  std::string out, err;
};

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

// A fresh directory under the system's temporary directory.
inline std::filesystem::path make_temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

// Starts `program` with `args` (argv[0] = program), stdout and stderr going to files of
// `capture_dir`; the child's pid, or -1.
inline pid_t spawn_program(const std::string& program, const std::vector<std::string>& args,
                           const std::filesystem::path& capture_dir) {
  const std::filesystem::path out_path = capture_dir / "stdout", err_path = capture_dir / "stderr";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  std::vector<std::string> all = {program};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : all) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return spawned == 0 ? pid : -1;
}

// Waits for a child that spawn_program started and collects what it wrote.
inline Completed wait_program(pid_t pid, const std::filesystem::path& capture_dir) {
  Completed completed;
  if (pid < 0) {
    completed.err = "posix_spawn failed";
    return completed;
  }
  int status = 0;
  waitpid(pid, &status, 0);
  // A crash (signal) reads as a distinct negative code, never as a clean failure.
  completed.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  completed.out = read_text(capture_dir / "stdout");
  completed.err = read_text(capture_dir / "stderr");
  return completed;
}

// Runs `program` with `args` to the end.
inline Completed run_program(const std::string& program, const std::vector<std::string>& args,
                             const std::filesystem::path& capture_dir) {
  return wait_program(spawn_program(program, args, capture_dir), capture_dir);
}

// Runs the CLI (FLASHATTN_CLI_PATH) with `args`, stdout and stderr captured in files of
// `capture_dir`.
inline Completed run_cli(const std::vector<std::string>& args,
                         const std::filesystem::path& capture_dir) {
  return run_program(FLASHATTN_CLI_PATH, args, capture_dir);
}

// A failure as the CLI must fail: nothing on stdout and exactly one line on stderr,
// "flashattn: error: ...", holding `message`. `command` names the run in the test's messages.
inline void expect_one_error_line(const Completed& completed, const std::string& command,
                                  const std::string& message) {
  EXPECT_EQ(completed.out, "") << command;
  EXPECT_EQ(completed.err.rfind("flashattn: error: ", 0), 0u) << command << "\n" << completed.err;
  EXPECT_EQ(std::count(completed.err.begin(), completed.err.end(), '\n'), 1) << command << "\n"
                                                                             << completed.err;
  EXPECT_NE(completed.err.find(message), std::string::npos)
      << command << "\nexpected '" << message << "' in: " << completed.err;
}

// A test of the CLI: a fresh work directory and a directory for the captured stdout and stderr,
// both under the system's temporary directory, named from `prefix`, removed after the test.
class CliFixture : public ::testing::Test {
 protected:
  explicit CliFixture(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    work_ = make_temp_dir(prefix_ + "_");
    capture_ = make_temp_dir(prefix_ + "_capture_");
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(work_, ignored);
    std::filesystem::remove_all(capture_, ignored);
  }

  std::string path(const std::string& name) const { return (work_ / name).string(); }

  // Names in the work directory, hidden ones included, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(work_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Every name under the work directory, relative to it, hidden ones included, sorted.
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(work_)) {
      names.push_back(std::filesystem::relative(entry.path(), work_).string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  Completed run(const std::vector<std::string>& args) const { return run_cli(args, capture_); }

  std::filesystem::path work_, capture_;

 private:
  std::string prefix_;
};

// A flat JSON object as `run` prints it: key -> raw value text (strings without their quotes).
// Throws std::runtime_error on anything else, which fails the calling test.
inline std::map<std::string, std::string> parse_json_line(const std::string& line) {
  std::map<std::string, std::string> fields;
  std::size_t pos = 0;
  auto fail = [&](const std::string& problem) {
    throw std::runtime_error("bad JSON (" + problem + " at " + std::to_string(pos) + "): " + line);
  };
  auto peek = [&] { return pos < line.size() ? line[pos] : '\0'; };
  auto skip = [&] {
    while (std::isspace(static_cast<unsigned char>(peek()))) ++pos;
  };
  auto expect = [&](char wanted) {
    skip();
    if (peek() != wanted) fail(std::string("expected '") + wanted + "'");
    ++pos;
    skip();
  };
  auto until = [&](const char* stops) {
    const std::size_t end = line.find_first_of(stops, pos);
    if (end == std::string::npos) fail("unterminated value");
    std::string text = line.substr(pos, end - pos);
    pos = end;
    return text;
  };

  expect('{');
  while (true) {
    expect('"');
    const std::string key = until("\"");
    expect('"');
    expect(':');
    if (peek() == '"') {
      ++pos;
      fields[key] = until("\"");
      ++pos;
    } else if (peek() == '[') {
      fields[key] = until("]") + "]";
      ++pos;
    } else {
      fields[key] = until(",}");
    }
    skip();
    if (peek() == '}') break;
    expect(',');
  }
  expect('}');
  if (pos != line.size()) fail("text after the object");
  return fields;
}

}  // namespace flashattn::testing
