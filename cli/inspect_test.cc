// sdpa inspect's numbers (inspect.h): each head's picture against the block averages of the
// whole call's float64 weights (kReference), exact where one cell is one weight; the per-head
// views against the whole call (masks, seqlens_k, ALiBi per batch, sinks, GQA); flags; the PNGs
// libpng writes, read back; and the page's pieces.
#include "inspect.h"

#include <gtest/gtest.h>
#include <png.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using sdpa::DType;
using sdpa::TensorView;

struct Call {
  int64_t B = 2, Hq = 4, Hkv = 2, Nq = 37, Nk = 150, D = 8;
  std::vector<double> q, k, v, slopes, sinks;
  std::vector<uint8_t> mask, blocks;
  std::vector<int64_t> seqlens;
  sdpa_inspect::Request request;

  // Rank 3 (B = 1), a bool mask per head (Hq, Nq, Nk), a block mask per head of 8 x 16 blocks
  // and a window: the other ways a head's view is cut.
  void make_rank3(unsigned seed) {
    Call& c = *this;
    c.B = 1;
    c.q.resize(static_cast<size_t>(c.Hq * c.Nq * c.D));
    c.k.resize(static_cast<size_t>(c.Hkv * c.Nk * c.D));
    c.v.resize(c.k.size());
    std::mt19937 rng(seed);
    c.mask.resize(static_cast<size_t>(c.Hq * c.Nq * c.Nk));
    for (uint8_t& m : c.mask) m = rng() % 5 != 0;
    const int64_t qb = (c.Nq + 7) / 8, kb = (c.Nk + 15) / 16;
    c.blocks.resize(static_cast<size_t>(c.Hq * qb * kb));
    for (uint8_t& m : c.blocks) m = rng() % 3 != 0;
    sdpa::Inputs& in = c.request.inputs;
    in.q = TensorView::contiguous(c.q.data(), DType::kFloat64, {c.Hq, c.Nq, c.D});
    in.k = TensorView::contiguous(c.k.data(), DType::kFloat64, {c.Hkv, c.Nk, c.D});
    in.v = TensorView::contiguous(c.v.data(), DType::kFloat64, {c.Hkv, c.Nk, c.D});
    in.mask = TensorView::contiguous(c.mask.data(), DType::kBool, {c.Hq, c.Nq, c.Nk});
    c.request.options.block_mask = TensorView::contiguous(c.blocks.data(), DType::kBool, {c.Hq, qb, kb});
    c.request.options.block_q = 8;
    c.request.options.block_k = 16;
    c.request.options.window = {60, 10};
  }

  explicit Call(unsigned seed, bool extras) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal;
    const auto fill = [&](std::vector<double>& x, int64_t n) {
      x.resize(static_cast<size_t>(n));
      for (double& e : x) e = normal(rng);
    };
    fill(q, B * Hq * Nq * D);
    fill(k, B * Hkv * Nk * D);
    fill(v, B * Hkv * Nk * D);
    request.inputs = {TensorView::contiguous(q.data(), DType::kFloat64, {B, Hq, Nq, D}),
                      TensorView::contiguous(k.data(), DType::kFloat64, {B, Hkv, Nk, D}),
                      TensorView::contiguous(v.data(), DType::kFloat64, {B, Hkv, Nk, D}), std::nullopt};
    request.options.backend = sdpa::Backend::kReference;  // per row: a head's call is bit for bit the whole call's
    if (!extras) return;
    mask.resize(static_cast<size_t>(B * Nq * Nk));  // (B, 1, Nq, Nk): broadcast over heads
    for (uint8_t& m : mask) m = rng() % 4 != 0;
    for (int64_t j = 0; j < Nk; ++j) mask[static_cast<size_t>(5 * Nk + j)] = 0;  // batch 0, row 5: nothing
    request.inputs.mask = TensorView::contiguous(mask.data(), DType::kBool, {B, 1, Nq, Nk});
    seqlens = {Nk, 100};
    request.inputs.seqlens_k = TensorView::contiguous(seqlens.data(), DType::kInt64, {B});
    for (int64_t x = 0; x < B * Hq; ++x) slopes.push_back(0.01 * static_cast<double>(x + 1));
    request.options.alibi_slopes = TensorView::contiguous(slopes.data(), DType::kFloat64, {B, Hq});
    for (int64_t h = 0; h < Hq; ++h) sinks.push_back(0.3 * static_cast<double>(h));
    request.options.sinks = TensorView::contiguous(sinks.data(), DType::kFloat64, {Hq});
    request.options.causal = sdpa::Causal::kBottomRight;
  }

  // The whole call's weights and entropy (kReference), B·Hq·Nq × Nk and B·Hq·Nq.
  void whole(std::vector<double>& weights, std::vector<double>& entropy) {
    std::vector<double> out(static_cast<size_t>(B * Hq * Nq * D));
    weights.resize(static_cast<size_t>(B * Hq * Nq * Nk));
    entropy.resize(static_cast<size_t>(B * Hq * Nq));
    sdpa::Outputs o{TensorView::contiguous(out.data(), DType::kFloat64, {B, Hq, Nq, D}),
                    TensorView::contiguous(weights.data(), DType::kFloat64, {B, Hq, Nq, Nk}), std::nullopt};
    o.stats.entropy = TensorView::contiguous(entropy.data(), DType::kFloat64, {B, Hq, Nq});
    if (request.inputs.q.rank == 3) {
      o.out = TensorView::contiguous(out.data(), DType::kFloat64, {Hq, Nq, D});
      o.weights = TensorView::contiguous(weights.data(), DType::kFloat64, {Hq, Nq, Nk});
      o.stats.entropy = TensorView::contiguous(entropy.data(), DType::kFloat64, {Hq, Nq});
    }
    sdpa::attention(request.inputs, o, request.options);
  }
};

void expect_grids_average_the_weights(Call& c, int64_t cells) {
  c.request.cells = cells;
  c.request.max_heads = 100;
  std::vector<double> w, H;
  c.whole(w, H);
  const std::vector<sdpa_inspect::HeadSummary> heads = sdpa_inspect::summarize(c.request);
  ASSERT_EQ(static_cast<int64_t>(heads.size()), c.B * c.Hq);
  const int64_t Gq = std::min(c.Nq, cells), Gk = std::min(c.Nk, cells);
  for (const auto& s : heads) {
    SCOPED_TRACE("head " + std::to_string(s.b) + "," + std::to_string(s.h));
    ASSERT_EQ(s.rows, Gq);
    ASSERT_EQ(s.cols, Gk);
    const double* head_w = w.data() + (s.b * c.Hq + s.h) * c.Nq * c.Nk;
    for (int64_t gi = 0; gi < Gq; ++gi) {
      for (int64_t gj = 0; gj < Gk; ++gj) {
        double sum = 0;
        int64_t n = 0;
        for (int64_t i = 0; i < c.Nq; ++i) {
          for (int64_t j = 0; j < c.Nk; ++j) {
            if (i * Gq / c.Nq != gi || j * Gk / c.Nk != gj) continue;
            sum += head_w[i * c.Nk + j];
            ++n;
          }
        }
        const double got = s.grid[static_cast<size_t>(gi * Gk + gj)];
        if (sum == 0) {
          EXPECT_EQ(got, -1.0) << gi << "," << gj;  // every weight 0: grey
        } else {
          EXPECT_NEAR(got, sum / static_cast<double>(n), 1e-15) << gi << "," << gj;
        }
      }
    }
    for (int64_t i = 0; i < c.Nq; ++i) {  // the head's statistics are the whole call's, bit for bit
      EXPECT_EQ(s.entropy[static_cast<size_t>(i)], H[static_cast<size_t>((s.b * c.Hq + s.h) * c.Nq + i)]);
    }
  }
}

TEST(Inspect, OneCellPerWeightWhenItFits) {
  Call c(1, false);
  expect_grids_average_the_weights(c, 512);
}

TEST(Inspect, BlockAveragesOfLongInputs) {
  Call c(2, false);
  expect_grids_average_the_weights(c, 16);
}

TEST(Inspect, HeadViewsOfMasksLengthsAlibiAndSinks) {
  Call c(3, true);
  expect_grids_average_the_weights(c, 512);
  Call d(4, true);
  expect_grids_average_the_weights(d, 7);
}

TEST(Inspect, HeadViewsOfRank3PerHeadMasksBlockMasksAndWindows) {
  Call c(8, false);
  c.make_rank3(8);
  expect_grids_average_the_weights(c, 512);
  Call d(9, false);
  d.make_rank3(9);
  expect_grids_average_the_weights(d, 9);
}

TEST(Inspect, RowSumsAndFlags) {
  Call c(5, false);
  std::fill(c.q.begin(), c.q.end(), 0.0);  // every score 0: uniform rows
  for (const auto& s : sdpa_inspect::summarize(c.request)) {
    EXPECT_NEAR(s.row_sum_min, 1.0, 1e-12);
    EXPECT_NEAR(s.row_sum_max, 1.0, 1e-12);
    EXPECT_EQ(s.flag, "near-uniform");
  }
  for (double& x : c.q) x = 0;
  for (int64_t x = 0; x < c.B * c.Hkv * c.Nk * c.D; ++x) c.k[static_cast<size_t>(x)] = x % (c.Nk * c.D) == 0 ? 1.0 : 0.0;
  for (int64_t x = 0; x < c.B * c.Hq * c.Nq * c.D; ++x) c.q[static_cast<size_t>(x)] = x % c.D == 0 ? 1e3 : 0.0;
  for (const auto& s : sdpa_inspect::summarize(c.request)) {  // key 0 takes every row
    EXPECT_EQ(s.flag, "near-one-hot");
    EXPECT_EQ(s.argmax[0], 0);
  }
}

// The PNG that libpng wrote, read back by libpng: size and pixels.
TEST(Inspect, PngReadsBack) {
  const int w = 5, h = 3;
  std::vector<unsigned char> rgb(static_cast<size_t>(w * h * 3));
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<unsigned char>(i * 7);
  const std::vector<unsigned char> png = sdpa_inspect::encode_png(rgb, w, h);
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  ASSERT_TRUE(png_image_begin_read_from_memory(&image, png.data(), png.size()));
  EXPECT_EQ(image.width, static_cast<png_uint_32>(w));
  EXPECT_EQ(image.height, static_cast<png_uint_32>(h));
  image.format = PNG_FORMAT_RGB;
  std::vector<unsigned char> back(PNG_IMAGE_SIZE(image));
  ASSERT_TRUE(png_image_finish_read(&image, nullptr, back.data(), 0, nullptr));
  EXPECT_EQ(back, rgb);
}

TEST(Inspect, PageHasTheHeadsAndTheirPictures) {
  Call c(6, false);
  c.request.max_heads = 3;
  int64_t calls = 0;
  c.request.progress = [&](int64_t done, int64_t total) {
    EXPECT_EQ(done, ++calls);
    EXPECT_EQ(total, 3);
  };
  const std::string html = sdpa_inspect::report_html(c.request);
  EXPECT_EQ(calls, 3);
  for (const char* piece : {"id='head-0-0'", "id='head-0-2'", "heads drawn</th><td>3 of 8", "data:image/png;base64,",
                            "entropy (nats)", "max weight"}) {
    EXPECT_NE(html.find(piece), std::string::npos) << piece;
  }
  EXPECT_EQ(html.find("id='head-0-3'"), std::string::npos);
  // 37 x 150 cells at 640 / 150 = 4 pixels each.
  EXPECT_NE(html.find("width='600' height='148'"), std::string::npos);
}

TEST(Inspect, BadRequestsAreErrors) {
  Call c(7, false);
  c.request.topk = 33;
  EXPECT_THROW(sdpa_inspect::summarize(c.request), sdpa::Error);
  c.request.topk = 8;
  c.request.inputs.k.shape[3] = 7;  // Dk differs from q's
  EXPECT_THROW(sdpa_inspect::summarize(c.request), sdpa::Error);
}

}  // namespace
