// `flashattn bench`, run as a subprocess on its tiny --quick sweep: it verifies every path, writes
// a complete CSV (and a plot, or says why not) and nothing else; bad arguments fail with one line
// and leave no file. No assertion here is about time: benchmarks are not tests.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cli_test_support.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"

namespace {

namespace fs = std::filesystem;
using flashattn::testing::Completed;

const char* const kHeader =
    "date,host,cpu_model,simd_target,bf16_products,fma_target,openblas_core,openblas_coretype_env,"
    "threads,"
    "repeat,case,dtype,batch,heads,seqlen_q,seqlen_kv,head_dim,causal,impl,flops,seconds,gflops,"
    "cpu_share,verified,out_err,out_tol,lse_err,lse_tol,ratio_peak,ratio_sgemm,ratio_standard,"
    "peak_gflops,fma_peak_gflops,bf16_dot_peak_gflops,amx_peak_gflops,sgemm_gflops,copy_gbps,"
    "backward_flops,backward_seconds,backward_gflops,backward_cpu_share,backward_over_forward,"
    "backward_ratio_standard,backward_verified,backward_oracle,dq_err,dq_tol,dk_err,dk_tol,dv_err,"
    "dv_tol,heads_kv,kv_bytes,kv_gbps,ratio_copy,read_gbps,ratio_read,peak_paired_gflops,"
    "ratio_peak_paired,one_thread_seconds,speedup_over_one_thread";

const char* const kBackwardColumns[] = {"backward_flops",
                                        "backward_seconds",
                                        "backward_gflops",
                                        "backward_cpu_share",
                                        "backward_over_forward",
                                        "backward_ratio_standard",
                                        "backward_verified",
                                        "backward_oracle",
                                        "dq_err",
                                        "dq_tol",
                                        "dk_err",
                                        "dk_tol",
                                        "dv_err",
                                        "dv_tol"};

// RFC 4180 records: quoted fields may hold commas, doubled quotes and line breaks.
std::vector<std::vector<std::string>> parse_csv(const std::string& text) {
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> record;
  std::string field;
  bool quoted = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      record.push_back(field);
      field.clear();
    } else if (c == '\n') {
      record.push_back(field);
      field.clear();
      records.push_back(record);
      record.clear();
    } else {
      field += c;
    }
  }
  EXPECT_TRUE(field.empty() && record.empty()) << "the CSV does not end with a line break";
  return records;
}

class BenchCliTest : public flashattn::testing::CliFixture {
 protected:
  BenchCliTest() : CliFixture("flashattn_bench") {}

  fs::path results() const { return work_ / "results"; }

  // The name of the last CSV in results/ (a run writes one), empty if there is none.
  std::string csv_name() const {
    std::string name;
    for (const auto& entry : fs::directory_iterator(results())) {
      if (entry.path().extension() == ".csv") name = entry.path().filename().string();
    }
    return name;
  }

  // The rows of the one CSV in results(), as column name -> value; checks the header.
  std::vector<std::map<std::string, std::string>> read_rows() const {
    std::vector<fs::path> csvs;
    for (const auto& entry : fs::directory_iterator(results())) {
      if (entry.path().extension() == ".csv") csvs.push_back(entry.path());
    }
    EXPECT_EQ(csvs.size(), 1u);
    if (csvs.size() != 1) return {};
    const auto records = parse_csv(flashattn::testing::read_text(csvs.front()));
    EXPECT_FALSE(records.empty());
    if (records.empty()) return {};
    const std::vector<std::string> columns = parse_csv(std::string(kHeader) + "\n").front();
    EXPECT_EQ(records.front(), columns);
    std::vector<std::map<std::string, std::string>> rows;
    for (std::size_t r = 1; r < records.size(); ++r) {
      EXPECT_EQ(records[r].size(), columns.size()) << "row " << r;
      std::map<std::string, std::string> row;
      for (std::size_t c = 0; c < std::min(records[r].size(), columns.size()); ++c) {
        row[columns[c]] = records[r][c];
      }
      rows.push_back(row);
    }
    return rows;
  }

  void expect_clean_failure(const std::vector<std::string>& args, int exit_code,
                            const std::string& message) const {
    std::vector<std::string> all = {"bench", "--quick", "--out-dir", results().string()};
    all.insert(all.end(), args.begin(), args.end());
    const std::vector<std::string> before = files();
    const Completed completed = run(all);
    std::string command;
    for (const std::string& arg : args) command += " " + arg;
    EXPECT_EQ(completed.exit_code, exit_code) << command << "\n" << completed.err;
    flashattn::testing::expect_one_error_line(completed, command, message);
    EXPECT_EQ(files(), before) << command;
  }
};

TEST_F(BenchCliTest, QuickSweepVerifiesEveryPathAndWritesTheCsv) {
  const Completed completed =
      run({"bench", "--quick", "--threads", "2", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;

  // The quick sweep: seqlens 128 and 256 at head_dim 32, both masks, f32 and bf16, both paths;
  // then a decode case per dtype, checked below.
  const auto all_rows = read_rows();
  ASSERT_EQ(all_rows.size(), 20u) << completed.out;
  std::vector<std::map<std::string, std::string>> rows, decode_rows;
  for (const auto& row : all_rows) (row.at("case") == "decode" ? decode_rows : rows).push_back(row);
  ASSERT_EQ(rows.size(), 16u);
  std::set<std::string> cases;
  for (const auto& row : rows) {
    const std::string where =
        row.at("dtype") + " " + row.at("seqlen_q") + " " + row.at("causal") + " " + row.at("impl");
    cases.insert(where);
    EXPECT_EQ(row.at("verified"), "yes") << where;
    EXPECT_EQ(row.at("threads"), "2");
    EXPECT_EQ(row.at("case"), "sweep");
    EXPECT_EQ(row.at("batch"), "1");
    EXPECT_EQ(row.at("head_dim"), "32");
    EXPECT_EQ(row.at("seqlen_kv"), row.at("seqlen_q"));
    EXPECT_FALSE(row.at("simd_target").empty());
    EXPECT_FALSE(row.at("openblas_core").empty());

    flashattn::AttentionOptions options;
    options.causal = row.at("causal") == "true";
    const std::int64_t seqlen = std::stoll(row.at("seqlen_q"));
    EXPECT_DOUBLE_EQ(
        std::stod(row.at("flops")),
        flashattn::attention_flops(1, std::stoll(row.at("heads")), seqlen, seqlen, 32, options))
        << where;
    EXPECT_LE(std::stod(row.at("out_err")), std::stod(row.at("out_tol"))) << where;
    EXPECT_LE(std::stod(row.at("lse_err")), std::stod(row.at("lse_tol"))) << where;
    // Present and positive; their size is the machine's business.
    // ratio_peak_paired: each timed call came right after a run of the peak loop.
    for (const char* column : {"seconds", "gflops", "cpu_share", "ratio_peak", "ratio_sgemm",
                               "peak_gflops", "fma_peak_gflops", "sgemm_gflops", "copy_gbps",
                               "peak_paired_gflops", "ratio_peak_paired"}) {
      EXPECT_GT(std::stod(row.at(column)), 0.0) << where << ": " << column;
    }
    if (row.at("impl") == "flash") {
      EXPECT_GT(std::stod(row.at("ratio_standard")), 0.0) << where;
    } else {
      EXPECT_EQ(row.at("ratio_standard"), "") << where;
    }
    // Without --backward the backward columns are there and empty.
    for (const char* column : kBackwardColumns) EXPECT_EQ(row.at(column), "") << where << column;
    // Bandwidth is the decode cases' measure.
    EXPECT_EQ(row.at("heads_kv"), row.at("heads")) << where;
    for (const char* column : {"kv_bytes", "kv_gbps", "ratio_copy", "read_gbps", "ratio_read"}) {
      EXPECT_EQ(row.at(column), "") << where << column;
    }
    // One-thread runs are the seed shape's (or --scaling's), and the quick sweep has neither.
    EXPECT_EQ(row.at("one_thread_seconds"), "") << where;
    EXPECT_EQ(row.at("speedup_over_one_thread"), "") << where;
  }
  EXPECT_EQ(cases.size(), 16u);

  // Decode: one query position against 300 keys of 8 KV heads, K and V bytes per second.
  ASSERT_EQ(decode_rows.size(), 4u);
  std::set<std::string> decode_cases;
  for (const auto& row : decode_rows) {
    const std::string where = "decode " + row.at("dtype") + " " + row.at("impl");
    decode_cases.insert(where);
    EXPECT_EQ(row.at("verified"), "yes") << where;
    EXPECT_EQ(row.at("seqlen_q"), "1") << where;
    EXPECT_EQ(row.at("seqlen_kv"), "300") << where;
    EXPECT_EQ(row.at("heads"), "32") << where;
    EXPECT_EQ(row.at("heads_kv"), "8") << where;
    EXPECT_EQ(row.at("head_dim"), "128") << where;
    const double element = row.at("dtype") == "f32" ? 4.0 : 2.0;
    EXPECT_DOUBLE_EQ(std::stod(row.at("kv_bytes")), 2.0 * 300 * 8 * 128 * element) << where;
    flashattn::AttentionOptions options;
    options.causal = true;
    EXPECT_DOUBLE_EQ(std::stod(row.at("flops")),
                     flashattn::attention_flops(1, 32, 1, 300, 128, options))
        << where;
    EXPECT_LE(std::stod(row.at("out_err")), std::stod(row.at("out_tol"))) << where;
    const double seconds = std::stod(row.at("seconds")), gbps = std::stod(row.at("kv_gbps"));
    EXPECT_GT(seconds, 0.0) << where;
    // The CSV rounds seconds to 1e-6 and GB/s to 1e-2.
    EXPECT_NEAR(gbps, std::stod(row.at("kv_bytes")) / seconds * 1e-9,
                gbps * 0.5e-6 / seconds + 0.01)
        << where;
    // ratio_copy is of the unrounded figures, to 4 digits; gbps and copy_gbps are rounded to 0.01.
    const double copy = std::stod(row.at("copy_gbps")), ratio = gbps / copy;
    EXPECT_NEAR(std::stod(row.at("ratio_copy")), ratio,
                ratio * (0.005 / gbps + 0.005 / copy + 1e-4))
        << where;
    // Each call was timed after a read of the same K and V: that read's rate and the median
    // ratio over the pairs.
    EXPECT_GT(std::stod(row.at("read_gbps")), 0.0) << where;
    EXPECT_GT(std::stod(row.at("ratio_read")), 0.0) << where;
    // No sgemm ceiling at the decode head_dim in this sweep: the copy ceiling is the decode's,
    // and the read, not the peak loop, is what each call is paired with.
    EXPECT_EQ(row.at("sgemm_gflops"), "") << where;
    EXPECT_EQ(row.at("peak_paired_gflops"), "") << where;
    EXPECT_EQ(row.at("ratio_peak_paired"), "") << where;
  }
  EXPECT_EQ(decode_cases.size(), 4u);
  EXPECT_NE(completed.out.find("decode   one query position"), std::string::npos) << completed.out;
  EXPECT_NE(completed.out.find("f/pk run"), std::string::npos) << completed.out;
  for (const std::string dtype : {"f32", "bf16"}) {
    EXPECT_EQ(cases.count(dtype + " 256 false flash"), 1u) << dtype;
    EXPECT_EQ(cases.count(dtype + " 128 true standard"), 1u) << dtype;
  }

  // Progress on stderr, one line per case; where the outputs went on stdout.
  EXPECT_NE(completed.err.find("[10/10]"), std::string::npos) << completed.err;
  const std::string csv_name = this->csv_name();
  EXPECT_NE(completed.out.find("wrote "), std::string::npos) << completed.out;
  EXPECT_NE(completed.out.find(csv_name), std::string::npos) << completed.out;
  // A quick run's own name: a smoke test never replaces the day's full results.
  EXPECT_TRUE(csv_name.ends_with("-quick.csv")) << csv_name;

  // The plots (the sweep's and the decode cases'), or the reason there are none; never a
  // leftover temporary file.
  const std::string png_name = fs::path(csv_name).replace_extension(".png").string();
  const std::string decode_png_name = fs::path(csv_name).stem().string() + "-decode.png";
  if (fs::exists(results() / png_name)) {
    for (const std::string& name : {png_name, decode_png_name}) {
      EXPECT_GT(fs::file_size(results() / name), 0u) << name;
      EXPECT_NE(completed.out.find(name), std::string::npos) << completed.out;
    }
    EXPECT_EQ(files(), (std::vector<std::string>{"results", "results/" + decode_png_name,
                                                 "results/" + csv_name, "results/" + png_name}));
  } else {
    EXPECT_NE(completed.out.find("no plot: "), std::string::npos) << completed.out;
    EXPECT_EQ(files(), (std::vector<std::string>{"results", "results/" + csv_name}));
  }
}

TEST_F(BenchCliTest, OptionsSelectTheCasesAndPaths) {
  const Completed completed = run({"bench", "--quick", "--seqlens", "64,96", "--head-dims", "16",
                                   "--dtypes", "f32", "--impls", "flash", "--non-causal",
                                   "--no-plot", "--no-decode", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  EXPECT_NE(completed.out.find("no plot: --no-plot"), std::string::npos) << completed.out;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("impl"), "flash");
    EXPECT_EQ(row.at("dtype"), "f32");
    EXPECT_EQ(row.at("causal"), "false");
    EXPECT_EQ(row.at("head_dim"), "16");
    EXPECT_EQ(row.at("verified"), "yes");
    // Without a timed standard path there is nothing to compare with.
    EXPECT_EQ(row.at("ratio_standard"), "");
  }
  EXPECT_EQ(rows[0].at("seqlen_q"), "64");
  EXPECT_EQ(rows[1].at("seqlen_q"), "96");
  EXPECT_EQ(files().size(), 2u);  // results/ and the CSV
}

// --scaling times flash on one thread too, in alternation with the runs on all threads; with one
// thread there is nothing to compare, and the standard path is never timed so.
TEST_F(BenchCliTest, ScalingTimesFlashOnOneThreadToo) {
  for (const char* threads : {"2", "1"}) {
    const Completed completed =
        run({"bench", "--quick", "--scaling", "--threads", threads, "--seqlens", "64",
             "--head-dims", "16", "--dtypes", "f32", "--non-causal", "--no-plot", "--no-decode",
             "--out-dir", results().string()});
    ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
    EXPECT_NE(completed.out.find("f x thr"), std::string::npos) << completed.out;
    const auto rows = read_rows();
    ASSERT_EQ(rows.size(), 2u);
    for (const auto& row : rows) {
      const std::string where = std::string(threads) + " threads, " + row.at("impl");
      EXPECT_EQ(row.at("threads"), threads) << where;
      if (row.at("impl") == "flash" && std::string(threads) == "2") {
        EXPECT_GT(std::stod(row.at("one_thread_seconds")), 0.0) << where;
        EXPECT_GT(std::stod(row.at("speedup_over_one_thread")), 0.0) << where;
      } else {
        EXPECT_EQ(row.at("one_thread_seconds"), "") << where;
        EXPECT_EQ(row.at("speedup_over_one_thread"), "") << where;
      }
    }
    fs::remove_all(results());
  }
}

// Every gradient checked on the verified rows; the column names of `checked` hold numbers with
// error <= tolerance, the others are empty.
void expect_backward_checks(const std::map<std::string, std::string>& row,
                            const std::set<std::string>& checked, const std::string& where) {
  for (const std::string gradient : {"dq", "dk", "dv"}) {
    const std::string error = row.at(gradient + "_err"), tolerance = row.at(gradient + "_tol");
    if (checked.count(gradient) == 0) {
      EXPECT_EQ(error, "") << where << " " << gradient;
      EXPECT_EQ(tolerance, "") << where << " " << gradient;
      continue;
    }
    ASSERT_FALSE(error.empty() || tolerance.empty()) << where << " " << gradient;
    EXPECT_GE(std::stod(error), 0.0) << where << " " << gradient;
    EXPECT_GT(std::stod(tolerance), 0.0) << where << " " << gradient;
    EXPECT_LE(std::stod(error), std::stod(tolerance)) << where << " " << gradient;
  }
}

TEST_F(BenchCliTest, BackwardVerifiesAndTimesEveryPath) {
  const Completed completed = run({"bench", "--quick", "--backward", "--threads", "2",
                                   "--no-decode", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  EXPECT_NE(completed.out.find("2.5 x attention_flops"), std::string::npos) << completed.out;

  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 16u) << completed.out;
  for (const auto& row : rows) {
    const std::string where =
        row.at("dtype") + " " + row.at("seqlen_q") + " " + row.at("causal") + " " + row.at("impl");
    EXPECT_EQ(row.at("verified"), "yes") << where;
    EXPECT_EQ(row.at("backward_verified"), "yes") << where;
    // The quick sweep's slices are far below the reference budget.
    EXPECT_EQ(row.at("backward_oracle"), "reference") << where;

    flashattn::AttentionOptions options;
    options.causal = row.at("causal") == "true";
    const std::int64_t seqlen = std::stoll(row.at("seqlen_q"));
    EXPECT_DOUBLE_EQ(std::stod(row.at("backward_flops")),
                     flashattn::attention_backward_flops(1, std::stoll(row.at("heads")), seqlen,
                                                         seqlen, 32, options))
        << where;
    EXPECT_DOUBLE_EQ(std::stod(row.at("backward_flops")), 2.5 * std::stod(row.at("flops")))
        << where;
    // The forward runs between the peak loop's and the backward's: still paired with the loop.
    for (const char* column : {"backward_seconds", "backward_gflops", "backward_cpu_share",
                               "backward_over_forward", "ratio_peak_paired"}) {
      const double value = std::stod(row.at(column));
      EXPECT_TRUE(std::isfinite(value)) << where << ": " << column;
      EXPECT_GT(value, 0.0) << where << ": " << column;
    }
    // The ratio is of the two times of the same row, which the CSV rounds to 1e-6 s each (the
    // ratio itself to 1e-4).
    const double ratio = std::stod(row.at("backward_over_forward"));
    const double forward_seconds = std::stod(row.at("seconds"));
    EXPECT_NEAR(ratio, std::stod(row.at("backward_seconds")) / forward_seconds,
                (ratio + 1.0) * 0.5e-6 / forward_seconds + 1e-4)
        << where;
    if (row.at("impl") == "flash") {
      EXPECT_GT(std::stod(row.at("backward_ratio_standard")), 0.0) << where;
    } else {
      EXPECT_EQ(row.at("backward_ratio_standard"), "") << where;
    }
    expect_backward_checks(row, {"dq", "dk", "dv"}, where);
  }

  // The backward has its own plot, next to the forward's.
  const std::string csv_name = this->csv_name();
  const std::string stem = fs::path(csv_name).stem().string();
  if (fs::exists(results() / (stem + ".png"))) {
    EXPECT_GT(fs::file_size(results() / (stem + "-backward.png")), 0u);
    EXPECT_NE(completed.out.find(stem + "-backward.png"), std::string::npos) << completed.out;
    EXPECT_EQ(files(),
              (std::vector<std::string>{"results", "results/" + stem + "-backward.png",
                                        "results/" + csv_name, "results/" + stem + ".png"}));
  } else {
    EXPECT_NE(completed.out.find("no plot: "), std::string::npos) << completed.out;
    EXPECT_EQ(files(), (std::vector<std::string>{"results", "results/" + csv_name}));
  }
}

// A reference budget below every slice: the reference checks dQ on sampled rows, the standard
// path is the oracle of flash's dK and dV (and is run on the slice even though only flash is
// timed).
TEST_F(BenchCliTest, BackwardBeyondTheReferenceBudgetComparesWithTheStandardPath) {
  const Completed completed =
      run({"bench", "--quick", "--backward", "--backward-reference-work", "1e-6", "--dtypes", "f32",
           "--impls", "flash", "--no-plot", "--no-decode", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  EXPECT_NE(completed.out.find("reference-dq-rows+standard"), std::string::npos) << completed.out;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 4u);
  for (const auto& row : rows) {
    const std::string where = row.at("seqlen_q") + " " + row.at("causal");
    EXPECT_EQ(row.at("impl"), "flash");
    EXPECT_EQ(row.at("backward_verified"), "yes") << where;
    EXPECT_EQ(row.at("backward_oracle"), "reference-dq-rows+standard") << where;
    EXPECT_GT(std::stod(row.at("backward_over_forward")), 0.0) << where;
    // No timed standard path: no speed-up.
    EXPECT_EQ(row.at("backward_ratio_standard"), "") << where;
    expect_backward_checks(row, {"dq", "dk", "dv"}, where);
  }

  // The standard path alone: only its dQ rows have an oracle.
  const Completed standard =
      run({"bench", "--quick", "--backward", "--backward-reference-work", "1e-6", "--dtypes", "f32",
           "--impls", "standard", "--seqlens", "128", "--causal", "--no-plot", "--no-decode",
           "--out-dir", (work_ / "standard").string()});
  ASSERT_EQ(standard.exit_code, 0) << standard.out << standard.err;
  EXPECT_NE(standard.out.find("against reference-dq-rows"), std::string::npos) << standard.out;
}

// Decode cases alone: --no-sweep and --no-seed-shape leave them, one per dtype and KV cache
// length, each verified; only their plot is drawn (the sweep's would be empty).
TEST_F(BenchCliTest, DecodeCasesAloneReportBandwidth) {
  const Completed completed =
      run({"bench", "--quick", "--no-sweep", "--no-seed-shape", "--dtypes", "f16", "--impls",
           "flash", "--decode-seqlens", "100,700", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].at("seqlen_kv"), "100");
  EXPECT_EQ(rows[1].at("seqlen_kv"), "700");
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("case"), "decode");
    EXPECT_EQ(row.at("impl"), "flash");
    EXPECT_EQ(row.at("dtype"), "f16");
    EXPECT_EQ(row.at("verified"), "yes");
    EXPECT_GT(std::stod(row.at("kv_gbps")), 0.0);
    // Without a timed standard path there is nothing to compare with.
    EXPECT_EQ(row.at("ratio_standard"), "");
  }
  const std::string stem = fs::path(csv_name()).stem().string();
  if (fs::exists(results() / (stem + "-decode.png"))) {
    EXPECT_GT(fs::file_size(results() / (stem + "-decode.png")), 0u);
    EXPECT_EQ(completed.out.find("no plot"), std::string::npos) << completed.out;
    EXPECT_EQ(files(), (std::vector<std::string>{"results", "results/" + stem + "-decode.png",
                                                 "results/" + stem + ".csv"}));
  } else {
    EXPECT_NE(completed.out.find("no plot: gnuplot is not on PATH"), std::string::npos)
        << completed.out;
    EXPECT_EQ(files().size(), 2u);  // results/ and the CSV
  }
}

TEST_F(BenchCliTest, BadArgumentsFailWithOneLineAndNoFile) {
  expect_clean_failure({"--dtypes", "f64"}, 2, "--dtypes");
  expect_clean_failure({"--seqlens", "0"}, 2, "--seqlens");
  expect_clean_failure({"--seqlens", "12x"}, 2, "--seqlens");
  expect_clean_failure({"--head-dims", "-64"}, 2, "--head-dims");
  expect_clean_failure({"--impls", "reference"}, 2, "--impls");
  // Both benchmarked paths have a backward; the reference is the oracle, not a timed path.
  expect_clean_failure({"--backward", "--impls", "reference"}, 2, "--impls");
  expect_clean_failure({"--backward", "--backward-reference-work", "0"}, 2,
                       "--backward-reference-work");
  expect_clean_failure({"--causal", "--both"}, 2, "excludes");
  expect_clean_failure({"--repeat", "0"}, 2, "--repeat");
  expect_clean_failure({"--work", "0"}, 2, "--work");
  expect_clean_failure({"--threads", "-1"}, 2, "--threads");
  // Beyond flashattn::kMaxThreads: refused when parsed (before, the ceilings crashed the tool).
  expect_clean_failure({"--threads", "100000"}, 2,
                       "--threads: Value 100000 not in range 0 to 1024");
  expect_clean_failure({"--frobnicate"}, 2, "--frobnicate");
  expect_clean_failure({"--decode-seqlens", "0"}, 2, "--decode-seqlens");
  expect_clean_failure({"--no-sweep", "--no-decode"}, 2, "expected at least one case to run");

  // An --out-dir that cannot be a directory: fails before any work, creates nothing.
  const fs::path blocker = work_ / "file";
  std::ofstream(blocker) << "x";
  const std::vector<std::string> before = files();
  const Completed completed =
      run({"bench", "--quick", "--out-dir", (blocker / "results").string()});
  EXPECT_EQ(completed.exit_code, 1) << completed.err;
  EXPECT_EQ(completed.out, "");
  EXPECT_EQ(completed.err.rfind("flashattn: error: --out-dir", 0), 0u) << completed.err;
  EXPECT_EQ(std::count(completed.err.begin(), completed.err.end(), '\n'), 1) << completed.err;
  EXPECT_EQ(files(), before);
}

TEST_F(BenchCliTest, HelpStatesTheSweepRule) {
  const Completed completed = run({"bench", "--help"});
  EXPECT_EQ(completed.exit_code, 0);
  for (const char* text :
       {"bench [OPTIONS]", "--seqlens", "--head-dims", "--dtypes", "--impls", "--out-dir",
        "--quick", "H = max(1, round(W / FLOPs of one head))", "--backward", "2.5x attention_flops",
        "--backward-reference-work", "--decode-seqlens", "--no-decode", "--no-sweep",
        "GB/s of K and V read", "ratio_peak_paired", "--scaling", "speedup_over_one_thread"}) {
    EXPECT_NE(completed.out.find(text), std::string::npos) << text << "\n" << completed.out;
  }
  EXPECT_TRUE(files().empty());
}

}  // namespace
