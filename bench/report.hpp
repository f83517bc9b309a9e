#pragma once

// What `flashattn bench` reports: the CSV of every case and path, and the tables printed as the
// cases run.

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cases.hpp"
#include "machine.hpp"
#include "measure.hpp"

namespace flashattn::cli {

// `value` by the printf `pattern`; optional_number: empty where there is no value.
inline std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), pattern, value);
  return text;
}

inline std::string optional_number(const char* pattern, std::optional<double> value) {
  return value ? format(pattern, *value) : "";
}

// The CSV: its header line and a row per case and path.
std::string csv_text(const Machine& machine, const Ceilings& ceilings,
                     const std::vector<CaseResult>& results, int repeat);

// The machine, the ceilings and what the columns mean; then the sweep table's header, when there
// are sweep or seed-shape cases (`sweep_table`).
void print_header(const Machine& machine, const Ceilings& ceilings, const BenchOptions& options,
                  bool sweep_table);

// A row of the sweep table.
void print_case(const CaseResult& result, const Ceilings& ceilings, bool backward);

// The decode table's header: printed before its first case, after the sweep's.
void print_decode_header(const BenchOptions& options);

// A row of the decode table.
void print_decode_case(const CaseResult& result, const Ceilings& ceilings);

}  // namespace flashattn::cli
