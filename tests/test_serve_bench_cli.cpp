// `flashattn serve-bench`, run as a subprocess on its --quick sizes: every part verifies, the CSV
// has a row per part and cache, the plots are whole or said to be missing; bad arguments fail with
// one line and leave no file. No assertion is about time.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_support.hpp"

namespace {

namespace fs = std::filesystem;
using flashattn::testing::Completed;

const char* const kHeader =
    "date,host,threads,part,cache,q_dtype,cache_dtype,requests,kv_tokens,page_size,heads_q,"
    "heads_kv,head_dim,step_seconds,tokens_per_s,kv_gbps,read_gbps,ratio_read,paged_over_dense,"
    "copy_gbps,verified,max_error,tolerance,real_gflops,computed_gflops,varlen_over_padded,"
    "huge_page_share,kv_layout";

class ServeBenchCliTest : public flashattn::testing::CliFixture {
 protected:
  ServeBenchCliTest() : CliFixture("flashattn_serve_bench") {}

  fs::path results() const { return work_ / "results"; }

  // The CSV's rows as header -> field (no field of this CSV holds a comma).
  std::vector<std::map<std::string, std::string>> read_rows() const {
    std::vector<fs::path> csvs;
    for (const auto& entry : fs::directory_iterator(results())) {
      if (entry.path().extension() == ".csv") csvs.push_back(entry.path());
    }
    EXPECT_EQ(csvs.size(), 1u);
    if (csvs.empty()) return {};
    std::istringstream text(flashattn::testing::read_text(csvs[0]));
    std::string line;
    std::getline(text, line);
    EXPECT_EQ(line, kHeader);
    const auto split = [](const std::string& record) {
      std::vector<std::string> fields;
      std::stringstream stream(record);
      std::string field;
      while (std::getline(stream, field, ',')) fields.push_back(field);
      if (!record.empty() && record.back() == ',') fields.emplace_back();
      return fields;
    };
    const std::vector<std::string> names = split(kHeader);
    std::vector<std::map<std::string, std::string>> rows;
    while (std::getline(text, line)) {
      const std::vector<std::string> fields = split(line);
      EXPECT_EQ(fields.size(), names.size()) << line;
      std::map<std::string, std::string> row;
      for (std::size_t i = 0; i < names.size() && i < fields.size(); ++i) row[names[i]] = fields[i];
      rows.push_back(row);
    }
    return rows;
  }
};

// Quantized caches in both parts (HND too, whose scales keep the row-major layout): verified
// against the fp64 reference on the dequantized values, dense and paged bit for bit.
TEST_F(ServeBenchCliTest, QuantizedCachesAreVerified) {
  const Completed completed =
      run({"serve-bench", "--quick", "--no-prefill", "--cache-dtype", "int8", "--kv-layout", "HND",
           "--page-size", "7", "--single-dtypes", "int8,fp8_e4m3,fp8_e5m2", "--out-dir",
           results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 7u);  // serve, then dense and paged per single dtype
  EXPECT_EQ(rows[0].at("cache_dtype"), "int8");
  const char* dtypes[] = {"int8", "fp8_e4m3", "fp8_e5m2"};
  for (std::size_t i = 1; i < 7; ++i) EXPECT_EQ(rows[i].at("cache_dtype"), dtypes[(i - 1) / 2]);
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("verified"), "yes");
    EXPECT_LE(std::stod(row.at("max_error")), std::stod(row.at("tolerance")));
  }
}

TEST_F(ServeBenchCliTest, QuickRunVerifiesEveryPartAndWritesTheCsv) {
  const Completed completed = run(
      {"serve-bench", "--quick", "--single-dtypes", "f32,bf16", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 7u);  // serve, dense and paged per single dtype, varlen and padded
  EXPECT_EQ(rows[0].at("part"), "serve");
  EXPECT_EQ(rows[0].at("cache"), "paged");
  EXPECT_EQ(rows[0].at("cache_dtype"), "bf16");
  EXPECT_EQ(rows[0].at("requests"), "4");
  for (std::size_t i = 1; i < 5; ++i) {
    EXPECT_EQ(rows[i].at("part"), "single");
    EXPECT_EQ(rows[i].at("cache"), i % 2 ? "dense" : "paged");
    EXPECT_EQ(rows[i].at("kv_tokens"), "300");
    EXPECT_EQ(rows[i].at("paged_over_dense").empty(), i % 2 == 1) << i;
  }
  for (std::size_t i = 5; i < 7; ++i) {
    EXPECT_EQ(rows[i].at("part"), "prefill");
    EXPECT_EQ(rows[i].at("cache"), i == 5 ? "varlen" : "padded");
    EXPECT_EQ(rows[i].at("requests"), "3");
    EXPECT_GT(std::stod(rows[i].at("real_gflops")), 0.0);
    EXPECT_GT(std::stod(rows[i].at("computed_gflops")), 0.0);
    EXPECT_EQ(rows[i].at("varlen_over_padded").empty(), i == 6);
  }
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("verified"), "yes");
    EXPECT_LE(std::stod(row.at("max_error")), std::stod(row.at("tolerance")));
    EXPECT_EQ(row.at("huge_page_share"), "");  // not asked for
    if (row.at("part") == "prefill") {
      EXPECT_EQ(row.at("page_size"), "");
      EXPECT_EQ(row.at("kv_layout"), "");
      continue;
    }
    EXPECT_EQ(row.at("kv_layout"), "NHD");
    EXPECT_EQ(row.at("page_size"), "16");
    EXPECT_GT(std::stod(row.at("kv_gbps")), 0.0);
    EXPECT_GT(std::stod(row.at("read_gbps")), 0.0);
    EXPECT_GT(std::stod(row.at("tokens_per_s")), 0.0);
  }
  bool plot = false;
  for (const auto& entry : fs::directory_iterator(results())) {
    if (entry.path().extension() == ".png") {
      plot = true;
      EXPECT_GT(fs::file_size(entry.path()), 0u);
    }
  }
  if (!plot) {
    EXPECT_NE(completed.out.find("no plot: gnuplot is not on PATH"), std::string::npos)
        << completed.out;
  }
}

// Several page sizes: one server row each, on the same requests; --huge-pages reports the share the
// kernel granted (the quick caches are below one huge page, so any share in [0, 1] is right).
TEST_F(ServeBenchCliTest, PageSizesRunTheServerOncePerSizeOnTheSameRequests) {
  const Completed completed =
      run({"serve-bench", "--quick", "--page-size", "1,7,16", "--huge-pages", "--single-dtypes",
           "bf16", "--no-prefill", "--no-plot", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 5u);  // serve at 3 page sizes, dense and paged
  const char* const sizes[] = {"1", "7", "16"};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    EXPECT_EQ(row.at("part"), i < 3 ? "serve" : "single") << i;
    EXPECT_EQ(row.at("page_size"), i < 3 ? sizes[i] : "1") << i;  // part 2 takes the first
    EXPECT_EQ(row.at("kv_tokens"), rows[i < 3 ? 0 : 3].at("kv_tokens")) << i;
    EXPECT_EQ(row.at("verified"), "yes");
    ASSERT_FALSE(row.at("huge_page_share").empty()) << i;
    EXPECT_GE(std::stod(row.at("huge_page_share")), 0.0);
    EXPECT_LE(std::stod(row.at("huge_page_share")), 1.0);
  }
  EXPECT_NE(completed.out.find("on huge pages"), std::string::npos) << completed.out;
}

// Head-major caches (each KV head's rows together, seen through strides): both parts verify
// against the reference, and dense and paged agree bit for bit (paged_over_dense is only
// written then, and verified says yes).
TEST_F(ServeBenchCliTest, HeadMajorCachesVerifyInBothParts) {
  const Completed completed =
      run({"serve-bench", "--quick", "--kv-layout", "HND", "--page-size", "7", "--single-dtypes",
           "f32,bf16", "--no-prefill", "--no-plot", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  const auto rows = read_rows();
  ASSERT_EQ(rows.size(), 5u);  // serve, then dense and paged for each dtype
  for (std::size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].at("kv_layout"), "HND") << i;
    EXPECT_EQ(rows[i].at("verified"), "yes") << i;
    EXPECT_LE(std::stod(rows[i].at("max_error")), std::stod(rows[i].at("tolerance"))) << i;
  }
  EXPECT_NE(completed.out.find("cache HND"), std::string::npos) << completed.out;

  const Completed bad =
      run({"serve-bench", "--quick", "--kv-layout", "BHSD", "--out-dir", (work_ / "bad").string()});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--kv-layout"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(work_ / "bad"));
}

// A sweep of page sizes gets a plot of its own, also without part 2 (whose plot is then left
// out); one page size without part 2 has nothing to plot and says so.
TEST_F(ServeBenchCliTest, PageSizesSweepIsPlottedOnItsOwn) {
  const Completed completed = run({"serve-bench", "--quick", "--page-size", "4,16", "--no-single",
                                   "--no-prefill", "--out-dir", results().string()});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  std::vector<std::string> plots;
  for (const auto& entry : fs::directory_iterator(results())) {
    if (entry.path().extension() != ".png") continue;
    plots.push_back(entry.path().filename().string());
    EXPECT_GT(fs::file_size(entry.path()), 0u);
  }
  if (completed.out.find("no plot: gnuplot is not on PATH") == std::string::npos) {
    ASSERT_EQ(plots.size(), 1u) << completed.out;
    EXPECT_NE(plots[0].find("-quick-serve-pages.png"), std::string::npos) << plots[0];
  } else {
    EXPECT_TRUE(plots.empty());
  }

  const fs::path single_size = work_ / "single-size";
  const Completed alone = run(
      {"serve-bench", "--quick", "--no-single", "--no-prefill", "--out-dir", single_size.string()});
  ASSERT_EQ(alone.exit_code, 0) << alone.out << alone.err;
  EXPECT_NE(alone.out.find("no plot: --no-single and one --page-size"), std::string::npos)
      << alone.out;
  for (const auto& entry : fs::directory_iterator(single_size)) {
    EXPECT_NE(entry.path().extension(), ".png") << entry.path();
  }
}

TEST_F(ServeBenchCliTest, BadArgumentsFailWithOneLineAndNoFile) {
  const auto expect_clean_failure = [&](std::vector<std::string> args, int code,
                                        const std::string& message) {
    args.insert(args.begin(), {"serve-bench", "--quick", "--out-dir", results().string()});
    const Completed completed = run(args);
    EXPECT_EQ(completed.exit_code, code) << completed.err;
    flashattn::testing::expect_one_error_line(completed, args[4], message);
    EXPECT_FALSE(fs::exists(results())) << args[4];
  };
  expect_clean_failure({"--requests", "0"}, 2, "--requests");
  expect_clean_failure({"--page-size", "0"}, 2, "--page-size");
  expect_clean_failure({"--page-size", "16,0"}, 2, "--page-size");
  expect_clean_failure({"--cache-dtype", "f64"}, 2, "--cache-dtype");
  expect_clean_failure({"--min-len", "700", "--max-len", "600"}, 1,
                       "--min-len: expected at most --max-len = 600, got 700");
  expect_clean_failure({"--heads-q", "6", "--heads-kv", "4"}, 1,
                       "--heads-kv: expected a divisor of --heads-q = 6, got 4");
  expect_clean_failure({"--q-dtype", "bf16", "--cache-dtype", "f16"}, 1,
                       "--cache-dtype: expected bf16");
  expect_clean_failure({"--single-seqlens", "0"}, 2, "--single-seqlens");
  expect_clean_failure({"--prefill-min", "300", "--prefill-max", "200"}, 1,
                       "--prefill-min: expected at most --prefill-max = 200, got 300");
}

TEST_F(ServeBenchCliTest, HelpSaysWhatIsMeasured) {
  const Completed completed = run({"serve-bench", "--help"});
  EXPECT_EQ(completed.exit_code, 0);
  for (const char* text :
       {"--requests", "--min-len", "--max-len", "--page-size", "--steps", "--cache-dtype",
        "--single-seqlens", "log-uniform", "paged/dense", "fp64", "shuffled", "--prefill-sequences",
        "varlen/padded", "--huge-pages"}) {
    EXPECT_NE(completed.out.find(text), std::string::npos) << text << "\n" << completed.out;
  }
  EXPECT_TRUE(files().empty());
}

}  // namespace
