// sdpa inspect's numbers (inspect.h): each head's picture against the block averages of the
// whole call's float64 weights (kReference), exact where one cell is one weight; the per-head
// views against the whole call (masks, seqlens_k, ALiBi per batch, sinks, GQA); flags; the PNGs
// libpng writes, read back; the colour bars' scales and labels, and the axis ticks of pooled
// pictures; and the page's pieces.
#include "inspect.h"

#include <gtest/gtest.h>
#include <png.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <random>
#include <regex>
#include <sstream>
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

// x with `digits` significant digits, as the page writes its labels (and 17 for exact values).
std::string digits(double x, int digits) {
  std::ostringstream os;
  os.precision(digits);
  os << x;
  return os.str();
}

// The page's part for head (b, h): its section.
std::string section_of(const std::string& html, int64_t b, int64_t h) {
  const size_t at = html.find("id='head-" + std::to_string(b) + '-' + std::to_string(h) + "'");
  EXPECT_NE(at, std::string::npos);
  return html.substr(at, html.find("</section>", at) - at);
}

// The first capture group of each match of `pattern` in `text`.
std::vector<std::string> captures(const std::string& text, const std::string& pattern) {
  std::vector<std::string> out;
  const std::regex re(pattern);
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    out.push_back((*it)[1].str());
  }
  return out;
}

// The 99th percentile of the cells that hold a weight by its definition (nearest rank): the
// smallest with at least 99% of them at or below it.
double percentile99(const std::vector<double>& grid) {
  std::vector<double> cells;
  for (double w : grid) {
    if (w > 0) cells.push_back(w);
  }
  std::sort(cells.begin(), cells.end());
  for (size_t r = 1; r <= cells.size(); ++r) {
    if (100 * r >= 99 * cells.size()) return cells[r - 1];
  }
  return 0;
}

// Each head's two colour bars: their tops are the 99th percentile of its cells (linear) and the
// largest cell (log), written exactly, and their labels are 0 .. top in quarters (linear, the top
// clipping brighter cells) and the five decades below the largest cell (log), to 3 digits. With
// 512 cells the picture is 37 x 150 cells; with 10 it is 10 x 10 = 100 cells of block averages,
// where the nearest-rank 99th percentile is the second largest cell, not the largest.
TEST(Inspect, ColourBarsShowEachScaleWithItsValues) {
  for (int64_t cells : {512, 10}) {
    SCOPED_TRACE("cells " + std::to_string(cells));
    Call c(6, false);
    c.request.max_heads = 3;
    c.request.cells = cells;
    const std::vector<sdpa_inspect::HeadSummary> heads = sdpa_inspect::summarize(c.request);
    const std::string html = sdpa_inspect::report_html(c.request);
    ASSERT_EQ(heads.size(), 3u);
    for (const auto& s : heads) {
      const double top = percentile99(s.grid), largest = *std::max_element(s.grid.begin(), s.grid.end());
      ASSERT_GT(top, 0);
      if (cells == 10) {
        EXPECT_LT(top, largest);  // 100 cells: rank 99 of 100
      }
      EXPECT_EQ(sdpa_inspect::colour_scale(s, false).top, top);
      EXPECT_EQ(sdpa_inspect::colour_scale(s, true).top, largest);
      const std::string section = section_of(html, s.b, s.h);
      EXPECT_EQ(captures(section, "<img class='colourbar' alt='[^']*' data-top='([^']*)'"),
                (std::vector<std::string>{digits(top, 17), digits(largest, 17)}));
      EXPECT_EQ(std::stod(digits(top, 17)), top);  // 17 digits: the exact value
      std::vector<std::string> labels;
      for (double x : {0.0, 0.25, 0.5, 0.75}) labels.push_back(digits(x * top, 3));
      labels.push_back("&ge; " + digits(top, 3));
      labels.push_back("&le; " + digits(largest * 1e-5, 3));
      for (double x : {1e-4, 1e-3, 1e-2, 1e-1, 1.0}) labels.push_back(digits(x * largest, 3));
      EXPECT_EQ(captures(section, "<text class='cbar-label'[^>]*>([^<]*)</text>"), labels);
    }
  }
}

// A head without a weight (every key masked): grey cells, no scale, no bar.
TEST(Inspect, NoColourBarWithoutWeights) {
  Call c(6, false);
  c.request.max_heads = 1;
  std::vector<uint8_t> none(static_cast<size_t>(c.Nq * c.Nk), 0);
  c.request.inputs.mask = TensorView::contiguous(none.data(), DType::kBool, {c.Nq, c.Nk});
  const auto heads = sdpa_inspect::summarize(c.request);
  EXPECT_EQ(sdpa_inspect::colour_scale(heads[0], false).top, 0);
  const std::string html = sdpa_inspect::report_html(c.request);
  EXPECT_NE(html.find("class='heatmap'"), std::string::npos);
  EXPECT_EQ(html.find("class='colourbar'"), std::string::npos);
  EXPECT_EQ(html.find("class='cbar-label'"), std::string::npos);
}

// The ticks of an axis of n indices in `cells` cells of px pixels: at 0, s, 2s, ... with s the
// smallest round step (1, 2, 5 x 10^k) giving at most 6 ticks 40 pixels apart on average, each
// in the cell whose run holds its index, at the middle of that index's share of the run.
void expect_ticks(int64_t n, int64_t cells, int px) {
  SCOPED_TRACE("n " + std::to_string(n) + ", cells " + std::to_string(cells) + ", px " + std::to_string(px));
  const auto fits = [&](int64_t s) { return (n - 1) / s + 1 <= 6 && static_cast<double>(s * cells * px) >= 40.0 * static_cast<double>(n); };
  std::vector<int64_t> steps;
  for (int64_t p = 1; p <= 1000000; p *= 10) steps.insert(steps.end(), {p, 2 * p, 5 * p});
  const auto step = *std::find_if(steps.begin(), steps.end(), fits);
  const std::vector<sdpa_inspect::Tick> ticks = sdpa_inspect::axis_ticks(n, cells, px);
  ASSERT_EQ(static_cast<int64_t>(ticks.size()), (n - 1) / step + 1);
  for (size_t t = 0; t < ticks.size(); ++t) {
    const int64_t i = static_cast<int64_t>(t) * step;
    EXPECT_EQ(ticks[t].index, i);
    const int64_t c = i * cells / n;
    int64_t first = -1, count = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (j * cells / n != c) continue;
      if (first < 0) first = j;
      ++count;
    }
    EXPECT_NEAR(ticks[t].pixel, px * (static_cast<double>(c) + (static_cast<double>(i - first) + 0.5) / static_cast<double>(count)), 1e-12);
    EXPECT_GE(ticks[t].pixel, static_cast<double>(c * px));
    EXPECT_LT(ticks[t].pixel, static_cast<double>((c + 1) * px));
  }
}

TEST(Inspect, TicksNameTheRealIndicesOfPooledCells) {
  // 150 keys in 16 cells of 40 pixels (9 or 10 keys a cell): key 50 is the 4th of cell 5's keys
  // 47..56, at 40 · (5 + 3.5 / 10) = 214; 37 rows in 16 cells: row 10 the first of cell 4's 10, 11.
  const auto keys = sdpa_inspect::axis_ticks(150, 16, 40), rows = sdpa_inspect::axis_ticks(37, 16, 40);
  ASSERT_EQ(keys.size(), 3u);
  EXPECT_EQ(keys[1].index, 50);
  EXPECT_DOUBLE_EQ(keys[1].pixel, 214);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[1].index, 10);
  EXPECT_DOUBLE_EQ(rows[1].pixel, 170);
  for (auto [n, cells, px] : {std::array<int64_t, 3>{150, 16, 40}, {37, 16, 40}, {2600, 100, 6}, {300, 100, 6}, {3, 3, 48},
                              {1, 1, 48}, {64, 64, 10}, {5000, 4096, 1}, {2, 2, 1}, {100000, 512, 1}}) {
    expect_ticks(n, cells, static_cast<int>(px));
  }
  // The page's figures: labels 0, 50, 100 under the keys and 0, 10, 20, 30 beside the rows, at
  // those pixels of the picture (whose content starts 48 + 1 pixels in, past its border).
  Call c(6, false);
  c.request.max_heads = 1;
  c.request.cells = 16;
  const std::string section = section_of(sdpa_inspect::report_html(c.request), 0, 0);
  const std::string figure = section.substr(0, section.find("</figure>"));
  EXPECT_EQ(captures(figure, "<text class='xtick'[^>]*>([^<]*)</text>"), (std::vector<std::string>{"0", "50", "100"}));
  EXPECT_EQ(captures(figure, "<text class='ytick'[^>]*>([^<]*)</text>"), (std::vector<std::string>{"0", "10", "20", "30"}));
  EXPECT_EQ(captures(figure, "<text class='xtick' x='([^']*)'")[1], "263");
  EXPECT_EQ(captures(figure, "<text class='ytick' x='[^']*' y='([^']*)'")[1], "171");
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
