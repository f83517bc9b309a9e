// libFuzzer target: varlen_attention_forward and varlen_attention_backward
// (flashattn/varlen.hpp). The input bytes choose the path, dtype, a ragged batch (each
// sequence's query and key lengths, zero included), each packed tensor's memory layout, the
// options, the data (NaN, ±inf and denormals included) and, for one input in eight, a corruption
// of the offsets or views that makes the call invalid.
//
// Invalid calls must raise flashattn::Error and leave every output untouched. Valid calls must
// not throw, must write nothing around their outputs' views, and must give, sequence by
// sequence, bit for bit what the same path gives on that sequence alone (attention_forward and
// attention_backward on views of the same rows): out, lse (at its [heads_q, total_q] place), dq,
// dk and dv. Accuracy against the reference is fuzz_attention's and fuzz_backward's.
//
// Then the same forward over K and V in pages (PagedKVView): the bytes left choose the page size,
// the pool's layout, the order in which pages are handed out, spare pages and table columns, and
// for one input in eight a corruption (a page out of range, a sequence longer than its pages, no
// table, page size 0) that must raise Error and write nothing. Pages no sequence holds and the
// rows past a sequence's keys are NaN, unread table entries out of range; a valid call must give
// the packed forward's out and lse bit for bit.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "fuzz_support.hpp"

namespace {

using flashattn::AttentionImpl;
using flashattn::DType;
using namespace fuzz_support;

struct Problem {
  AttentionImpl impl = AttentionImpl::flash;
  DType dtype = DType::f32;
  std::int64_t batch = 0, heads_q = 1, heads_kv = 1, head_dim = 1, head_dim_v = 1;
  std::vector<std::int32_t> cu_q = {0}, cu_k = {0};
  Tensor q, k, v, dout, out, dq, dk, dv;
  std::vector<float> lse;
  flashattn::AttentionOptions options;
  std::string description;

  flashattn::TensorView view(Tensor& t) {
    return {t.buffer.bytes.data(), dtype, t.shape, t.strides};
  }
  // Rows [begin, begin + count) of a packed tensor, as a view of the same memory.
  flashattn::TensorView rows(Tensor& t, std::int64_t begin, std::int64_t count) {
    flashattn::TensorView part = view(t);
    part.shape[1] = count;
    if (count > 0) {
      part.data = t.buffer.bytes.data() +
                  begin * t.strides[1] * static_cast<std::int64_t>(flashattn::dtype_size(dtype));
    }
    return part;
  }
};

[[noreturn]] void finding(const Problem& p, const std::string& what) {
  report_finding("fuzz_varlen", p.description, what);
}

Problem make_problem(FuzzedDataProvider& in) {
  Problem p;
  p.impl = fuzzed_impl(in);
  p.dtype = fuzzed_dtype(in);
  p.batch = in.ConsumeIntegralInRange(0, 4);
  p.heads_kv = in.ConsumeIntegralInRange(1, 2);
  p.heads_q = p.heads_kv * in.PickValueInArray({1, 2, 4});
  p.head_dim = in.PickValueInArray({1, 3, 8, 16, 17, 32, 64});
  // v's and out's head dim: mostly head_dim's (0, what an exhausted input picks).
  p.head_dim_v = in.PickValueInArray({0, 0, 0, 1, 5, 24});
  if (p.head_dim_v == 0) p.head_dim_v = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    p.cu_q.push_back(p.cu_q.back() + in.ConsumeIntegralInRange(0, 40));
    p.cu_k.push_back(p.cu_k.back() + in.ConsumeIntegralInRange(0, 40));
  }
  const std::int64_t total_q = p.cu_q.back(), total_k = p.cu_k.back();
  const Shape q_shape{1, total_q, p.heads_q, p.head_dim},
      k_shape{1, total_k, p.heads_kv, p.head_dim}, v_shape{1, total_k, p.heads_kv, p.head_dim_v},
      out_shape{1, total_q, p.heads_q, p.head_dim_v};
  p.q = fuzzed_layout(in, p.dtype, q_shape, true);
  p.k = fuzzed_layout(in, p.dtype, k_shape, true);
  p.v = fuzzed_layout(in, p.dtype, v_shape, true);
  p.dout = fuzzed_layout(in, p.dtype, out_shape, true);
  p.out = fuzzed_layout(in, p.dtype, out_shape, false);
  p.dq = fuzzed_layout(in, p.dtype, q_shape, false);
  p.dk = fuzzed_layout(in, p.dtype, k_shape, false);
  p.dv = fuzzed_layout(in, p.dtype, v_shape, false);
  for (Tensor* t : {&p.out, &p.dq, &p.dk, &p.dv}) mark_view(*t);
  p.lse.assign(static_cast<std::size_t>(std::max<std::int64_t>(p.heads_q * total_q, 1)), NAN);
  p.options = fuzzed_options(in);
  const bool specials = in.ConsumeIntegralInRange(0, 3) == 0;
  for (Tensor* t : {&p.q, &p.k, &p.v, &p.dout}) {
    fill(*t, p.dtype, in, in.ConsumeIntegralInRange(-8, 8), specials, true);
  }
  std::ostringstream text;
  text << flashattn::impl_name(p.impl) << " " << flashattn::dtype_name(p.dtype) << " cu_q [";
  for (auto x : p.cu_q) text << x << " ";
  text << "] cu_k [";
  for (auto x : p.cu_k) text << x << " ";
  text << "]";
  describe_tensor(text, "q", p.q);
  describe_tensor(text, "k", p.k);
  describe_tensor(text, "v", p.v);
  describe_tensor(text, "out", p.out);
  describe_options(text, p.options);
  p.description = text.str();
  return p;
}

// The call's arguments, which a corruption may change.
struct Call {
  flashattn::TensorView q, out;
  const std::int32_t* cu_q;
  std::vector<std::int32_t> cu_k;
  std::int64_t batch;
};

bool corrupt(Problem& p, int kind, Call& call) {
  switch (kind) {
    case 0:
      call.cu_k[0] = 1;
      return true;
    case 1:
      if (p.batch < 2 || call.cu_k[1] == 0) return false;
      std::swap(call.cu_k[1], call.cu_k[2]);
      return call.cu_k[1] != call.cu_k[2];
    case 2:
      call.cu_k.back() += 1;
      return true;
    case 3:
      call.cu_q = nullptr;
      return true;
    case 4:
      call.batch = -1;
      return true;
    case 5:
      call.q.shape[0] = 2;
      return true;
    case 6:
      if (call.q.shape[1] == 0) return false;
      call.out.data = call.q.data;
      return true;
    default:
      return false;
  }
}

std::vector<std::uint8_t> bytes_of_outputs(const Problem& p) {
  std::vector<std::uint8_t> bytes;
  for (const Tensor* t : {&p.out, &p.dq, &p.dk, &p.dv}) {
    bytes.insert(bytes.end(), t->buffer.bytes.begin(), t->buffer.bytes.end());
  }
  const auto* lse = reinterpret_cast<const std::uint8_t*>(p.lse.data());
  bytes.insert(bytes.end(), lse, lse + p.lse.size() * sizeof(float));
  return bytes;
}

// Whether the packed tensor's rows [begin, begin + count) hold the same bits as `alone`
// (contiguous [1, count, H, D]).
bool same_rows(const Problem& p, const Tensor& packed, std::int64_t begin,
               const std::vector<std::uint8_t>& alone) {
  const std::size_t element = flashattn::dtype_size(p.dtype);
  const std::int64_t heads = packed.shape[2], D = packed.shape[3];
  const std::int64_t count = static_cast<std::int64_t>(alone.size() / element) / (heads * D);
  for (std::int64_t s = 0; s < count; ++s) {
    for (std::int64_t h = 0; h < heads; ++h) {
      if (std::memcmp(packed.buffer.bytes.data() + packed.offset(0, begin + s, h, 0) * element,
                      alone.data() + ((s * heads + h) * D) * element, D * element) != 0) {
        return false;
      }
    }
  }
  return true;
}

// The packed K and V of `p` in a pool of pages, and the paged call's arguments.
struct PagedProblem {
  std::int64_t page_size = 1, num_pages = 0, pages_per_sequence = 0;
  Tensor k_pages, v_pages, out;
  std::vector<std::int32_t> table;
  std::vector<float> lse;

  flashattn::PagedKVView view(const Problem& p) const {
    return {{k_pages.buffer.bytes.data(), p.dtype, k_pages.shape, k_pages.strides},
            {v_pages.buffer.bytes.data(), p.dtype, v_pages.shape, v_pages.strides},
            table.data(),
            pages_per_sequence};
  }
};

PagedProblem make_paged(FuzzedDataProvider& in, Problem& p) {
  PagedProblem paged;
  paged.page_size = in.PickValueInArray({1, 2, 3, 7, 16, 64});
  std::vector<std::int64_t> pages(static_cast<std::size_t>(p.batch));
  std::int64_t most = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    pages[b] = (p.cu_k[b + 1] - p.cu_k[b] + paged.page_size - 1) / paged.page_size;
    most = std::max(most, pages[b]);
    paged.num_pages += pages[b];
  }
  paged.num_pages += in.ConsumeIntegralInRange(0, 2);
  paged.pages_per_sequence = most + in.ConsumeIntegralInRange(0, 2);
  const Shape pool{paged.num_pages, paged.page_size, p.heads_kv, p.head_dim};
  const Shape value_pool{paged.num_pages, paged.page_size, p.heads_kv, p.head_dim_v};
  const int order = in.ConsumeIntegralInRange(0, 5);
  const std::array<int, 4> pad{0, 0, in.ConsumeIntegralInRange(0, 1), 0};
  paged.k_pages = make_tensor(p.dtype, pool, order, pad, -1);
  paged.v_pages = make_tensor(p.dtype, value_pool, order, pad, -1);
  std::vector<std::int32_t> free_pages(static_cast<std::size_t>(paged.num_pages));
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::shuffle(free_pages.begin(), free_pages.end(),
               std::minstd_rand(in.ConsumeIntegral<std::uint32_t>()));
  paged.table.assign(
      static_cast<std::size_t>(std::max<std::int64_t>(p.batch * paged.pages_per_sequence, 1)), -1);
  for (std::size_t i = 1; i < paged.table.size(); i += 2) {
    paged.table[i] = static_cast<std::int32_t>(paged.num_pages);
  }
  std::size_t next = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t i = 0; i < pages[b]; ++i) {
      paged.table[b * paged.pages_per_sequence + i] = free_pages[next++];
    }
  }
  const std::size_t element = flashattn::dtype_size(p.dtype);
  for (Tensor* t : {&paged.k_pages, &paged.v_pages}) {
    for_each_index(t->shape, [&](auto a, auto b, auto c, auto d) {
      store_f32(t->buffer.bytes.data(), p.dtype, t->offset(a, b, c, d), NAN);
    });
  }
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t j = 0; j < p.cu_k[b + 1] - p.cu_k[b]; ++j) {
      const std::int64_t page = paged.table[b * paged.pages_per_sequence + j / paged.page_size];
      for (std::int64_t h = 0; h < p.heads_kv; ++h) {
        for (const auto& [pages_tensor, packed] :
             {std::pair{&paged.k_pages, &p.k}, std::pair{&paged.v_pages, &p.v}}) {
          std::memcpy(
              pages_tensor->buffer.bytes.data() +
                  pages_tensor->offset(page, j % paged.page_size, h, 0) * element,
              packed->buffer.bytes.data() + packed->offset(0, p.cu_k[b] + j, h, 0) * element,
              static_cast<std::size_t>(packed->shape[3]) * element);
        }
      }
    }
  }
  paged.out = fuzzed_layout(in, p.dtype, p.out.shape, false);
  mark_view(paged.out);
  paged.lse.assign(p.lse.size(), NAN);
  return paged;
}

// A corruption of the paged call that makes it invalid, or false where the problem has none.
bool corrupt_paged(Problem& p, int kind, PagedProblem& paged, flashattn::PagedKVView& kv,
                   std::vector<std::int32_t>& cu_k) {
  std::int64_t b = 0;  // the sequence with the most keys
  for (std::int64_t i = 1; i < p.batch; ++i) {
    if (p.cu_k[i + 1] - p.cu_k[i] > p.cu_k[b + 1] - p.cu_k[b]) b = i;
  }
  if (p.batch == 0 || p.cu_k[b + 1] == p.cu_k[b]) return false;
  switch (kind) {
    case 0:
      paged.table[b * paged.pages_per_sequence] = static_cast<std::int32_t>(paged.num_pages);
      return true;
    case 1:
      for (std::int64_t i = b + 1; i <= p.batch; ++i) {
        cu_k[i] += static_cast<std::int32_t>(paged.pages_per_sequence * paged.page_size);
      }
      return true;
    case 2:
      kv.block_table = nullptr;
      return true;
    case 3:
      kv.k.shape[1] = kv.v.shape[1] = 0;
      return true;
    default:
      return false;
  }
}

// The paged forward: refused and nothing written when corrupted, else the packed forward's bits.
void check_paged(FuzzedDataProvider& in, Problem& p) {
  const int corruption =
      in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange(0, 3) : -1;
  PagedProblem paged = make_paged(in, p);
  flashattn::PagedKVView kv = paged.view(p);
  std::vector<std::int32_t> cu_k = p.cu_k;
  const flashattn::TensorView out = p.view(paged.out);
  std::ostringstream text;
  text << " (paged, page_size " << paged.page_size << ", pages_per_sequence "
       << paged.pages_per_sequence;
  describe_tensor(text, "pool", paged.k_pages);
  text << ")";
  const std::string what = text.str();
  if (corruption >= 0 && corrupt_paged(p, corruption, paged, kv, cu_k)) {
    const std::vector<std::uint8_t> before = paged.out.buffer.bytes;
    try {
      flashattn::varlen_attention_forward(p.impl, p.view(p.q), kv, p.cu_q.data(), cu_k.data(),
                                          p.batch, out, paged.lse.data(), p.options);
    } catch (const flashattn::Error&) {
      if (paged.out.buffer.bytes != before ||
          std::any_of(paged.lse.begin(), paged.lse.end(), [](float x) { return !std::isnan(x); })) {
        finding(p, "an invalid call wrote before raising Error" + what + " corruption " +
                       std::to_string(corruption));
      }
      return;
    }
    finding(p, "an invalid call did not raise flashattn::Error" + what + " corruption " +
                   std::to_string(corruption));
  }
  try {
    flashattn::varlen_attention_forward(p.impl, p.view(p.q), kv, p.cu_q.data(), cu_k.data(),
                                        p.batch, out, paged.lse.data(), p.options);
  } catch (const flashattn::Error& error) {
    finding(p, std::string("a valid call raised Error: ") + error.what() + what);
  }
  const std::int64_t written = written_around_view(paged.out, p.dtype);
  if (written >= 0) finding(p, "wrote padding element " + std::to_string(written) + what);
  const std::size_t element = flashattn::dtype_size(p.dtype);
  for_each_index(p.out.shape, [&](auto a, auto s, auto h, auto d) {
    if (std::memcmp(paged.out.buffer.bytes.data() + paged.out.offset(a, s, h, d) * element,
                    p.out.buffer.bytes.data() + p.out.offset(a, s, h, d) * element, element) != 0) {
      finding(p, "out differs from the packed forward's at row " + std::to_string(s) + what);
    }
  });
  if (std::memcmp(paged.lse.data(), p.lse.data(), p.lse.size() * sizeof(float)) != 0) {
    finding(p, "lse differs from the packed forward's" + what);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int corruption =
      in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange(0, 6) : -1;
  Problem p = make_problem(in);
  Call call{p.view(p.q), p.view(p.out), p.cu_q.data(), p.cu_k, p.batch};

  if (corruption >= 0) {
    if (!corrupt(p, corruption, call)) return 0;
    p.description += " corruption " + std::to_string(corruption);
    const std::vector<std::uint8_t> before = bytes_of_outputs(p);
    try {
      flashattn::varlen_attention_forward(p.impl, call.q, p.view(p.k), p.view(p.v), call.cu_q,
                                          call.cu_k.data(), call.batch, call.out, p.lse.data(),
                                          p.options);
    } catch (const flashattn::Error&) {
      if (bytes_of_outputs(p) != before) finding(p, "an invalid call wrote before raising Error");
      return 0;
    }
    finding(p, "an invalid call did not raise flashattn::Error");
  }

  try {
    flashattn::varlen_attention_forward(p.impl, p.view(p.q), p.view(p.k), p.view(p.v),
                                        p.cu_q.data(), p.cu_k.data(), p.batch, p.view(p.out),
                                        p.lse.data(), p.options);
    flashattn::varlen_attention_backward(
        p.impl, p.view(p.dout), p.view(p.q), p.view(p.k), p.view(p.v), p.view(p.out), p.lse.data(),
        p.cu_q.data(), p.cu_k.data(), p.batch, p.view(p.dq), p.view(p.dk), p.view(p.dv), p.options);
  } catch (const flashattn::Error& error) {
    finding(p, std::string("a valid call raised Error: ") + error.what());
  }
  for (const Tensor* t : {&p.out, &p.dq, &p.dk, &p.dv}) {
    const std::int64_t written = written_around_view(*t, p.dtype);
    if (written >= 0) finding(p, "wrote padding element " + std::to_string(written));
  }

  const std::size_t element = flashattn::dtype_size(p.dtype);
  const std::int64_t total_q = p.cu_q.back(), Hq = p.heads_q, Hkv = p.heads_kv, D = p.head_dim,
                     Dv = p.head_dim_v;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t q0 = p.cu_q[b], Lq = p.cu_q[b + 1] - q0;
    const std::int64_t k0 = p.cu_k[b], Lk = p.cu_k[b + 1] - k0;
    std::vector<std::uint8_t> out(static_cast<std::size_t>(Lq * Hq * Dv) * element + 1);
    std::vector<std::uint8_t> dq(static_cast<std::size_t>(Lq * Hq * D) * element + 1),
        dk(static_cast<std::size_t>(Lk * Hkv * D) * element + 1);
    std::vector<std::uint8_t> dv(static_cast<std::size_t>(Lk * Hkv * Dv) * element + 1);
    std::vector<float> lse(static_cast<std::size_t>(Hq * Lq) + 1);
    const auto contiguous = [&](std::vector<std::uint8_t>& bytes, std::int64_t rows,
                                std::int64_t heads, std::int64_t dims) {
      return flashattn::contiguous_view(static_cast<void*>(bytes.data()), p.dtype,
                                        {1, rows, heads, dims});
    };
    try {
      flashattn::attention_forward(p.impl, p.rows(p.q, q0, Lq), p.rows(p.k, k0, Lk),
                                   p.rows(p.v, k0, Lk), contiguous(out, Lq, Hq, Dv), lse.data(),
                                   p.options);
      flashattn::attention_backward(
          p.impl, p.rows(p.dout, q0, Lq), p.rows(p.q, q0, Lq), p.rows(p.k, k0, Lk),
          p.rows(p.v, k0, Lk), contiguous(out, Lq, Hq, Dv), lse.data(), contiguous(dq, Lq, Hq, D),
          contiguous(dk, Lk, Hkv, D), contiguous(dv, Lk, Hkv, Dv), p.options);
    } catch (const flashattn::Error& error) {
      finding(p, std::string("the sequence alone raised Error: ") + error.what());
    }
    out.pop_back();
    dq.pop_back();
    dk.pop_back();
    dv.pop_back();
    const std::string where = " of sequence " + std::to_string(b);
    if (!same_rows(p, p.out, q0, out)) finding(p, "out differs from the sequence alone" + where);
    if (!same_rows(p, p.dq, q0, dq)) finding(p, "dq differs from the sequence alone" + where);
    if (!same_rows(p, p.dk, k0, dk)) finding(p, "dk differs from the sequence alone" + where);
    if (!same_rows(p, p.dv, k0, dv)) finding(p, "dv differs from the sequence alone" + where);
    for (std::int64_t h = 0; h < Hq; ++h) {
      if (Lq > 0 && std::memcmp(&p.lse[h * total_q + q0], &lse[h * Lq], Lq * sizeof(float)) != 0) {
        finding(p, "lse differs from the sequence alone" + where);
      }
    }
  }
  check_paged(in, p);
  return 0;
}
