// `sdpa inspect` and `sdpa.inspect`: one self-contained HTML page that shows, per head, what an
// attention call does: heatmaps of its weights (linear and log colour scales, each with a
// labelled colour bar and query/key index ticks; cells whose weight is exactly 0 in grey), the entropy and max weight of each query row, a table of shapes,
// row sums and entropy with a flag for near-uniform and near-one-hot heads, and each row's top
// keys. Everything comes from the library's fused kernel at O(Nq · cells) memory per head:
// Stats for the per-row numbers and Stats::pooled_weights for the pictures, so an input of any
// length gets a picture of at most `cells` × `cells` (exact, one cell per weight, when Nq and Nk
// fit; block averages of the weights beyond).
// Used by the CLI (cli/inspect_command.cc) and by the Python package (python/bindings.cc), which
// link the library themselves (this is an object library: one copy of sdpa per program).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa_inspect {

struct Request {
  sdpa::Inputs inputs;    // as sdpa::attention takes them (rank 2..4)
  sdpa::Options options;  // every option; dropout is left out (the weights are before dropout)
  int64_t topk = 8;       // top keys listed per row, 0..32
  int64_t cells = 512;    // picture resolution per axis: exact up to this Nq and Nk, averaged above
  int64_t max_heads = 16; // heads drawn and summarised, in order (b, h); the page says how many of all
  std::string title = "sdpa inspect";
  // Called after each head with (heads done, heads drawn): a progress bar for long work.
  std::function<void(int64_t, int64_t)> progress = nullptr;
};

// One head's numbers, as the report shows them (also what tests check).
struct HeadSummary {
  int64_t b = 0, h = 0;
  int64_t rows = 0, cols = 0;         // picture cells: query runs × key runs
  std::vector<double> grid;           // rows × cols: mean weight of each cell (-1: every weight 0)
  std::vector<double> entropy, entropy_normalized, max_weight;  // per query row
  std::vector<int64_t> argmax, allowed, topk_indices;           // topk_indices: Nq × topk
  std::vector<double> topk_weights;
  double row_sum_min = 0, row_sum_max = 0;  // over rows with an allowed key
  std::string flag;                         // "near-uniform", "near-one-hot" or ""
};

// The heads' summaries (the first max_heads heads), computed through sdpa::attention. A cell
// whose weights are all exactly 0 (blocked keys, or weights that underflowed) is -1 and drawn
// grey; so is a cell holding NaN (a NaN row).
std::vector<HeadSummary> summarize(const Request& request);
// The whole page.
std::string report_html(const Request& request);

// A heatmap's colour scale: a cell of mean weight w is viridis at position(w), clamped to [0, 1]:
//   linear: w / top, top = the 99th percentile of the head's cells that hold a weight (grid > 0),
//           by nearest rank (the smallest such cell with at least 99% of them at or below it);
//           brighter cells take the top colour (a few large cells, such as the first rows of a
//           causal head, would otherwise leave the rest dark);
//   log:    (log10(w / top) + 5) / 5, top = the largest cell: the five decades top·1e-5 .. top;
//           cells below top·1e-5 take the bottom colour.
// top is 0 when no cell holds a weight (every cell grey; the page draws no colour bar then).
struct ColourScale {
  bool log = false;
  double top = 0;
  double position(double w) const;  // before clamping
  double value_at(double p) const;  // the inverse: the weight drawn at position p in [0, 1]
  // The colour bar's labelled weights, bottom to top: linear 0, top/4, top/2, 3·top/4, top;
  // log top·1e-5, top·1e-4, ..., top·0.1, top (the six ends of the five decades).
  std::vector<double> labels() const;
};
ColourScale colour_scale(const HeadSummary& s, bool log);

// The colour of a cell of mean weight w (HeadSummary::grid) on `scale`, RGB: the one colour map
// of the heatmaps and of their colour bars (whose pixel rows are value_at's weights coloured by
// it); grey where w < 0 (every weight 0) or NaN.
std::array<unsigned char, 3> cell_colour(const ColourScale& scale, double w);

// An axis tick: the query (or key) `index` and the picture's pixel it is drawn at, from the
// picture's top (left) edge.
struct Tick {
  int64_t index = 0;
  double pixel = 0;
};
// The ticks of an axis of n indices drawn as `cells` = min(n, Request::cells) cells of px pixels
// each, cell c holding the run of indices i with floor(i · cells / n) = c: indices 0, s, 2s, ...
// below n, the step s the smallest of 1, 2, 5 × a power of 10 that gives at most 6 ticks,
// on average at least 40 pixels apart (s · cells · px / n >= 40); each at the middle of its index's share of its cell's run (the middle
// of its cell when a cell is one index), so a pooled picture's ticks name real indices.
std::vector<Tick> axis_ticks(int64_t n, int64_t cells, int px);

// Request::progress for a terminal: a bar on stderr when it is one, nothing otherwise.
std::function<void(int64_t, int64_t)> terminal_progress();

// A PNG of width × height RGB pixels (row-major, 3 bytes each), through libpng.
std::vector<unsigned char> encode_png(const std::vector<unsigned char>& rgb, int width, int height);

}  // namespace sdpa_inspect
