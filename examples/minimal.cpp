// The smallest use of flashattn: causal FlashAttention on random q, k, v, checked against the
// standard path, which materializes the whole score matrix.
#include <flashattn/flashattn.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  using flashattn::contiguous_view;
  const std::array<std::int64_t, 4> shape = {1, 128, 4, 64};  // [batch, seqlen, heads, head_dim]
  const std::size_t count = 1 * 128 * 4 * 64;

  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  const auto random_tensor = [&] {
    std::vector<float> tensor(count);
    for (float& x : tensor) x = normal(rng);
    return tensor;
  };
  const std::vector<float> q = random_tensor(), k = random_tensor(), v = random_tensor();
  std::vector<float> flash(count), standard(count);

  flashattn::AttentionOptions options;
  options.causal = true;
  flashattn::flash_attention_forward(
      contiguous_view(q.data(), shape), contiguous_view(k.data(), shape),
      contiguous_view(v.data(), shape), contiguous_view(flash.data(), shape), /*lse=*/nullptr,
      options);
  flashattn::attention_standard(contiguous_view(q.data(), shape), contiguous_view(k.data(), shape),
                                contiguous_view(v.data(), shape),
                                contiguous_view(standard.data(), shape), /*lse=*/nullptr, options);

  float max_difference = 0.0f;
  for (std::size_t i = 0; i < count; ++i) {
    max_difference = std::max(max_difference, std::abs(flash[i] - standard[i]));
  }
  std::printf("max |flash - standard| = %.3g\n", max_difference);
  return max_difference <= 1e-4f ? 0 : 1;
}
