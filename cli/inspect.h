// `sdpa inspect` and `sdpa.inspect`: one self-contained HTML page that shows, per head, what an
// attention call does: heatmaps of its weights (linear and log colour scales, cells whose weight
// is exactly 0 in grey), the entropy and max weight of each query row, a table of shapes,
// row sums and entropy with a flag for near-uniform and near-one-hot heads, and each row's top
// keys. Everything comes from the library's fused kernel at O(Nq · cells) memory per head:
// Stats for the per-row numbers and Stats::pooled_weights for the pictures, so an input of any
// length gets a picture of at most `cells` × `cells` (exact, one cell per weight, when Nq and Nk
// fit; block averages of the weights beyond).
// Used by the CLI (cli/inspect_command.cc) and by the Python package (python/bindings.cc), which
// link the library themselves (this is an object library: one copy of sdpa per program).
#pragma once

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

// Request::progress for a terminal: a bar on stderr when it is one, nothing otherwise.
std::function<void(int64_t, int64_t)> terminal_progress();

// A PNG of width × height RGB pixels (row-major, 3 bytes each), through libpng.
std::vector<unsigned char> encode_png(const std::vector<unsigned char>& rgb, int width, int height);

}  // namespace sdpa_inspect
