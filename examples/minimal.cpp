// Causal FlashAttention on random q, k, v, checked against the standard path.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <flashattn/flashattn.hpp>
#include <random>
#include <vector>

int main() {
  const std::array<std::int64_t, 4> shape = {1, 128, 4, 64};  // [batch, seqlen, heads, head_dim]
  std::vector<float> q(1 * 128 * 4 * 64), k(q.size()), v(q.size()), flash(q.size()),
      standard(q.size());
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  for (auto* tensor : {&q, &k, &v}) {
    std::generate(tensor->begin(), tensor->end(), [&] { return normal(rng); });
  }

  using flashattn::contiguous_view;
  flashattn::AttentionOptions options;
  options.causal = true;
  flashattn::flash_attention_forward(
      contiguous_view(q.data(), shape), contiguous_view(k.data(), shape),
      contiguous_view(v.data(), shape), contiguous_view(flash.data(), shape), /*lse=*/nullptr,
      options);
  flashattn::standard_attention_forward(
      contiguous_view(q.data(), shape), contiguous_view(k.data(), shape),
      contiguous_view(v.data(), shape), contiguous_view(standard.data(), shape), /*lse=*/nullptr,
      options);

  float max_difference = 0.0f;
  for (std::size_t i = 0; i < q.size(); ++i) {
    max_difference = std::max(max_difference, std::abs(flash[i] - standard[i]));
  }
  std::printf("max |flash - standard| = %.3g\n", max_difference);
  return max_difference <= 1e-4f ? 0 : 1;
}
