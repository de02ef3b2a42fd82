// The report of inspect.h: per-head calls of sdpa::attention on views of one head, with Stats
// and Stats::pooled_weights, turned into PNG heatmaps and colour bars (libpng), SVG ticks, labels
// and curves, and tables.
#include "inspect.h"

#include <png.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "storage.h"  // src/: the dtype table

namespace sdpa_inspect {
namespace {

using sdpa::DType;
using sdpa::TensorView;

// An owned array of one dtype (float32, float64 or int64) read back as double / int64.
struct Buffer {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  Buffer(DType t, std::vector<int64_t> s) : dtype(t), shape(std::move(s)) {
    bytes.resize(static_cast<size_t>(numel() * sdpa::dtype_size(t)));
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    return n;
  }
  TensorView view() {
    TensorView v;
    v.data = bytes.data();
    v.dtype = dtype;
    v.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = v.rank - 1; d >= 0; --d) {
      v.shape[d] = shape[static_cast<size_t>(d)];
      v.strides[d] = stride;
      stride *= shape[static_cast<size_t>(d)];
    }
    return v;
  }
  double real(int64_t i) const {
    if (dtype == DType::kFloat64) return reinterpret_cast<const double*>(bytes.data())[i];
    return reinterpret_cast<const float*>(bytes.data())[i];
  }
  int64_t integer(int64_t i) const { return reinterpret_cast<const int64_t*>(bytes.data())[i]; }
  std::vector<double> reals() const {
    std::vector<double> x(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) x[static_cast<size_t>(i)] = real(i);
    return x;
  }
  std::vector<int64_t> integers() const {
    const auto* p = reinterpret_cast<const int64_t*>(bytes.data());
    return std::vector<int64_t>(p, p + numel());
  }
};

struct Dims {
  int rank = 2;
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 0, Nk = 0, Dk = 0, Dv = 0;
};

Dims dims_of(const sdpa::Inputs& in) {
  Dims d;
  const int r = d.rank = in.q.rank;
  d.B = r == 4 ? in.q.shape[0] : 1;
  d.Hq = r >= 3 ? in.q.shape[r - 3] : 1;
  d.Hkv = r >= 3 ? in.k.shape[r - 3] : 1;
  d.Nq = in.q.shape[r - 2];
  d.Dk = in.q.shape[r - 1];
  d.Nk = in.k.shape[r - 2];
  d.Dv = in.v.shape[r - 1];
  return d;
}

// The element offset of index (b, h) of a view whose dims, right-aligned, end in (B, H, x, y),
// broadcast dims (extent 1) read at 0; and the view of its last `keep` dims there.
TensorView slice(const TensorView& t, int64_t b, int64_t h, int keep) {
  TensorView v = t;
  int64_t offset = 0;
  const int lead = t.rank - keep;  // dims before the kept ones: ..., B, H
  for (int d = 0; d < lead; ++d) {
    const int from_end = t.rank - keep - d;  // 1: H, 2: B
    const int64_t index = from_end == 1 ? h : b;
    if (t.shape[d] > 1) offset += index * t.strides[d];
  }
  if (t.data != nullptr) v.data = static_cast<char*>(t.data) + offset * sdpa::dtype_size(t.dtype);
  v.rank = std::min(keep, t.rank);
  for (int d = 0; d < v.rank; ++d) {
    v.shape[d] = t.shape[t.rank - v.rank + d];
    v.strides[d] = t.strides[t.rank - v.rank + d];
  }
  return v;
}

// Element x of a rank-1 view as a rank-1 view of one element.
TensorView element(const TensorView& t, int64_t x) {
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + x * t.strides[0] * sdpa::dtype_size(t.dtype);
  v.shape[0] = 1;
  return v;
}

// The call restricted to head (b, h): rank-2 q (Nq, Dk), k and v of its kv head, and the
// inputs and options that depend on (b, h) cut to it. Dropout is left out.
std::pair<sdpa::Inputs, sdpa::Options> head_call(const Request& r, const Dims& d, int64_t b, int64_t h) {
  const sdpa::Inputs& in = r.inputs;
  const int64_t kvh = h / (d.Hq / d.Hkv);
  sdpa::Inputs head{slice(in.q, b, h, 2), slice(in.k, b, kvh, 2), slice(in.v, b, kvh, 2), std::nullopt};
  if (in.mask) head.mask = slice(*in.mask, b, h, 2);
  if (in.seqlens_k) head.seqlens_k = element(*in.seqlens_k, in.seqlens_k->shape[0] == 1 ? 0 : b);
  sdpa::Options o = r.options;
  o.dropout_p = 0;
  if (o.alibi_slopes) {
    const TensorView& s = *o.alibi_slopes;
    if (s.rank == 1) {
      o.alibi_slopes = element(s, h);
    } else {  // (B, Hq) or (1, Hq): row b (or 0), as a (1,) view of element h
      TensorView row = s;
      row.rank = 1;
      row.shape[0] = s.shape[1];
      row.strides[0] = s.strides[1];
      row.data = static_cast<char*>(s.data) + (s.shape[0] == 1 ? 0 : b) * s.strides[0] * sdpa::dtype_size(s.dtype);
      o.alibi_slopes = element(row, h);
    }
  }
  if (o.sinks) o.sinks = element(*o.sinks, h);
  if (o.block_mask) o.block_mask = slice(*o.block_mask, b, h, 2);
  return {head, o};
}


// The Stats views of rows `rows` (lse's shape) and top k.
struct StatBuffers {
  Buffer allowed, entropy, normalized, max_weight, argmax, topk_w, topk_i;
  StatBuffers(DType ct, const std::vector<int64_t>& rows, int64_t k)
      : allowed(DType::kInt64, rows), entropy(ct, rows), normalized(ct, rows), max_weight(ct, rows),
        argmax(DType::kInt64, rows), topk_w(ct, with(rows, k)), topk_i(DType::kInt64, with(rows, k)) {}
  static std::vector<int64_t> with(std::vector<int64_t> s, int64_t k) {
    s.push_back(k);
    return s;
  }
  sdpa::Stats views() {
    sdpa::Stats s;
    s.allowed = allowed.view();
    s.entropy = entropy.view();
    s.entropy_normalized = normalized.view();
    s.max_weight = max_weight.view();
    s.argmax = argmax.view();
    s.topk_weights = topk_w.view();
    s.topk_indices = topk_i.view();
    return s;
  }
};

// Near-uniform: the rows' mean normalised entropy at least 0.9; near-one-hot: their mean max
// weight at least 0.9 (over rows with more than one allowed key).
std::string flag_of(const std::vector<double>& normalized, const std::vector<double>& max_weight,
                    const std::vector<int64_t>& allowed) {
  double sum_h = 0, sum_w = 0;
  int64_t n = 0;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (allowed[i] <= 1 || std::isnan(normalized[i])) continue;
    sum_h += normalized[i];
    sum_w += max_weight[i];
    ++n;
  }
  if (n == 0) return "";
  if (sum_h / static_cast<double>(n) >= 0.9) return "near-uniform";
  if (sum_w / static_cast<double>(n) >= 0.9) return "near-one-hot";
  return "";
}

// n indices cut into `cells` runs, index i in run floor(i · cells / n) (Stats::pooled_weights'
// rule): i's run, and run c's first index ceil(c · n / cells). In 128 bits: i · cells may pass
// int64_t (keys of shape (2^40, 0) exist without elements, and are counted, never walked).
int64_t run_of(int64_t i, int64_t cells, int64_t n) {
  __extension__ using Wide = __int128;
  return static_cast<int64_t>(static_cast<Wide>(i) * cells / n);
}
int64_t run_first(int64_t c, int64_t cells, int64_t n) {
  __extension__ using Wide = __int128;
  return static_cast<int64_t>((static_cast<Wide>(c) * n + cells - 1) / cells);
}

HeadSummary summarize_head(const Request& r, const Dims& d, int64_t b, int64_t h) {
  const auto [in, o] = head_call(r, d, b, h);
  const DType ct = sdpa::internal::compute_dtype(in.q.dtype);
  HeadSummary s;
  s.b = b;
  s.h = h;
  const int64_t G = std::min(d.Nk, r.cells), Gq = std::min(d.Nq, r.cells);
  Buffer out(in.q.dtype, {d.Nq, d.Dv}), pooled(ct, {d.Nq, G});
  StatBuffers st(ct, {d.Nq}, r.topk);
  sdpa::Outputs outs{out.view(), std::nullopt, std::nullopt, st.views()};
  outs.stats.pooled_weights = pooled.view();
  sdpa::attention(in, outs, o);
  s.entropy = st.entropy.reals();
  s.entropy_normalized = st.normalized.reals();
  s.max_weight = st.max_weight.reals();
  s.argmax = st.argmax.integers();
  s.allowed = st.allowed.integers();
  s.topk_weights = st.topk_w.reals();
  s.topk_indices = st.topk_i.integers();
  s.flag = flag_of(s.entropy_normalized, s.max_weight, s.allowed);
  // Row sums, and the picture: cell (gi, c) averages the weights of query run gi (rows i with
  // floor(i · Gq / Nq) = gi) and key run c (pooled_weights' runs).
  std::vector<int64_t> keys_in(static_cast<size_t>(G), 0), rows_in(static_cast<size_t>(Gq), 0);
  for (int64_t c = 0; c < G; ++c) keys_in[static_cast<size_t>(c)] = run_first(c + 1, G, d.Nk) - run_first(c, G, d.Nk);
  s.rows = Gq;
  s.cols = G;
  s.grid.assign(static_cast<size_t>(Gq * G), 0.0);
  bool first = true;
  for (int64_t i = 0; i < d.Nq; ++i) {
    const int64_t gi = i * Gq / d.Nq;
    ++rows_in[static_cast<size_t>(gi)];
    double sum = 0;
    for (int64_t c = 0; c < G; ++c) {
      const double w = pooled.real(i * G + c);
      sum += w;
      s.grid[static_cast<size_t>(gi * G + c)] += w;
    }
    if (s.allowed[static_cast<size_t>(i)] > 0) {
      s.row_sum_min = first ? sum : std::min(s.row_sum_min, sum);
      s.row_sum_max = first ? sum : std::max(s.row_sum_max, sum);
      first = false;
    }
  }
  for (int64_t gi = 0; gi < Gq; ++gi) {
    for (int64_t c = 0; c < G; ++c) {
      double& cell = s.grid[static_cast<size_t>(gi * G + c)];
      cell = cell == 0 ? -1.0 : cell / static_cast<double>(rows_in[static_cast<size_t>(gi)] * keys_in[static_cast<size_t>(c)]);
    }
  }
  return s;
}

// ---- Pictures ----

// viridis at 0, 1/8, ..., 1 (matplotlib's colour map), interpolated linearly.
constexpr std::array<std::array<double, 3>, 9> kViridis = {{{68, 1, 84},
                                                            {71, 44, 122},
                                                            {59, 81, 139},
                                                            {44, 113, 142},
                                                            {33, 144, 141},
                                                            {39, 173, 129},
                                                            {92, 200, 99},
                                                            {170, 220, 50},
                                                            {253, 231, 37}}};
constexpr unsigned char kZeroGrey = 190;  // cells whose weights are all exactly 0 (blocked)

std::array<unsigned char, 3> viridis(double x) {
  x = std::clamp(std::isnan(x) ? 0.0 : x, 0.0, 1.0) * 8;
  const int i = std::min(7, static_cast<int>(x));
  const double f = x - i;
  std::array<unsigned char, 3> c{};
  for (int k = 0; k < 3; ++k) c[k] = static_cast<unsigned char>(std::lround(kViridis[i][k] * (1 - f) + kViridis[i + 1][k] * f));
  return c;
}

void write_to_vector(png_structp png, png_bytep data, png_size_t n) {
  auto* out = static_cast<std::vector<unsigned char>*>(png_get_io_ptr(png));
  out->insert(out->end(), data, data + n);
}

std::string base64(const std::vector<unsigned char>& bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string s;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t n = static_cast<uint32_t>(bytes[i]) << 16 | (i + 1 < bytes.size() ? bytes[i + 1] << 8 : 0) |
                       (i + 2 < bytes.size() ? bytes[i + 2] : 0);
    s += kAlphabet[n >> 18 & 63];
    s += kAlphabet[n >> 12 & 63];
    s += i + 1 < bytes.size() ? kAlphabet[n >> 6 & 63] : '=';
    s += i + 2 < bytes.size() ? kAlphabet[n & 63] : '=';
  }
  return s;
}

// Pixels per cell: pictures about 640 px wide, at least one pixel and at most 48 per cell.
int cell_pixels(int64_t rows, int64_t cols) {
  return static_cast<int>(std::clamp<int64_t>(640 / std::max<int64_t>(1, std::max(rows, cols)), 1, 48));
}

// A width × height picture whose pixel (x, y) is colour(x, y), as a PNG data URI.
template <class Colour>
std::string png_uri(int width, int height, Colour colour) {
  std::vector<unsigned char> rgb(static_cast<size_t>(width) * static_cast<size_t>(height) * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      const std::array<unsigned char, 3> c = colour(x, y);
      std::memcpy(&rgb[(static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3], c.data(), 3);
    }
  }
  return "data:image/png;base64," + base64(encode_png(rgb, width, height));
}

// The head's grid, px × px pixels per cell: rows × px high, cols × px wide.
std::string heatmap_uri(const HeadSummary& s, const ColourScale& scale, int px) {
  return png_uri(static_cast<int>(s.cols) * px, static_cast<int>(s.rows) * px, [&](int x, int y) {
    return cell_colour(scale, s.grid[static_cast<size_t>((y / px) * s.cols + x / px)]);
  });
}

// The colour bar, `height` >= 2 pixel rows: row y (0 at the top) is the colour of the weight at
// position (height - 1 - y) / (height - 1), so the top row is top's colour and the bottom row
// that of 0 (linear) or top·1e-5 (log); a weight w sits at row bar_row(height, position(w)).
std::string colourbar_uri(const ColourScale& scale, int width, int height) {
  return png_uri(width, height, [&](int, int y) {
    return cell_colour(scale, scale.value_at(static_cast<double>(height - 1 - y) / (height - 1)));
  });
}
double bar_row(int height, double p) { return (1 - std::clamp(p, 0.0, 1.0)) * (height - 1); }

std::string fmt(double x, int digits = 4) {
  if (std::isnan(x)) return "nan";
  std::ostringstream os;
  os.precision(digits);
  os << x;
  return os.str();
}

std::string escape(const std::string& text) {
  std::string s;
  for (char c : text) {
    if (c == '<') s += "&lt;";
    else if (c == '>') s += "&gt;";
    else if (c == '&') s += "&amp;";
    else s += c;
  }
  return s;
}

// A curve of y over the query rows as an inline SVG polyline (NaN rows skipped).
std::string curve_svg(const std::string& title, const std::vector<double>& y, double y_top) {
  const double W = 640, H = 120;
  std::ostringstream os;
  os << "<figure class='curve'><figcaption>" << title << " (0 to " << fmt(y_top) << ") along query rows 0.."
     << (y.empty() ? 0 : y.size() - 1) << "</figcaption><svg width='" << W << "' height='" << H
     << "' viewBox='0 0 " << W << ' ' << H << "'><rect width='" << W << "' height='" << H
     << "' fill='#f7f7f7'/><polyline fill='none' stroke='#3b528b' stroke-width='1.5' points='";
  for (size_t i = 0; i < y.size(); ++i) {
    if (std::isnan(y[i])) continue;
    const double px = y.size() == 1 ? W / 2 : W * static_cast<double>(i) / static_cast<double>(y.size() - 1);
    const double py = H - 4 - (H - 8) * (y_top > 0 ? y[i] / y_top : 0);
    os << fmt(px, 6) << ',' << fmt(py, 6) << ' ';
  }
  os << "'/></svg></figure>\n";
  return os.str();
}

double mean_of(const std::vector<double>& x) {
  double s = 0;
  int64_t n = 0;
  for (double v : x) {
    if (!std::isnan(v)) s += v, ++n;
  }
  return n ? s / static_cast<double>(n) : 0.0;
}

// Layout of a heatmap figure (CSS pixels): row labels left of the picture, key labels under
// it, the colour bar right of it with its labels; pictures have a 1-pixel border.
constexpr int kAxisLeft = 48;  // the picture's left edge: room for row labels of 6 digits
constexpr int kBarGap = 16, kBarWidth = 14, kBarMinHeight = 150;

// One heatmap with its colour bar and ticks: an inline SVG of tick marks and labels under
// absolutely placed pictures (a figure of the head's linear or log scale).
std::string heatmap_figure(const HeadSummary& s, const Dims& d, bool log) {
  const ColourScale scale = colour_scale(s, log);
  const int px = cell_pixels(s.rows, s.cols);
  const int w = static_cast<int>(s.cols) * px, h = static_cast<int>(s.rows) * px;
  const int bar_left = kAxisLeft + w + 2 + kBarGap, bar_h = std::max(h, kBarMinHeight);
  const int width = bar_left + kBarWidth + 2 + 84, height = std::max(h + 2 + 22, bar_h + 2 + 8);
  std::ostringstream os;
  os << "<figure><figcaption class='axis'>" << (log ? "log10 scale" : "linear scale") << ": keys 0.." << d.Nk - 1
     << " &rarr;, queries 0.." << d.Nq - 1 << " &darr;</figcaption><div class='plot' style='width:" << width
     << "px;height:" << height << "px'><svg width='" << width << "' height='" << height << "'>";
  for (const Tick& t : axis_ticks(d.Nq, s.rows, px)) {  // query rows, left of the picture
    const std::string y = fmt(1 + t.pixel, 7);
    os << "<line x1='" << kAxisLeft - 5 << "' x2='" << kAxisLeft << "' y1='" << y << "' y2='" << y
       << "'/><text class='ytick' x='" << kAxisLeft - 7 << "' y='" << y << "' text-anchor='end' dominant-baseline='central'>"
       << t.index << "</text>";
  }
  for (const Tick& t : axis_ticks(d.Nk, s.cols, px)) {  // keys, under the picture
    const std::string x = fmt(kAxisLeft + 1 + t.pixel, 7);
    os << "<line x1='" << x << "' x2='" << x << "' y1='" << h + 2 << "' y2='" << h + 7 << "'/><text class='xtick' x='" << x
       << "' y='" << h + 19 << "' text-anchor='middle'>" << t.index << "</text>";
  }
  if (scale.top > 0) {  // the colour bar's labels: linear's top clips brighter cells, log's bottom darker ones
    const std::vector<double> labels = scale.labels();
    for (size_t i = 0; i < labels.size(); ++i) {
      const std::string y = fmt(1 + 0.5 + bar_row(bar_h, scale.position(labels[i])), 7);
      const char* clip = !log && i + 1 == labels.size() ? "&ge; " : log && i == 0 ? "&le; " : "";
      os << "<line x1='" << bar_left + kBarWidth + 2 << "' x2='" << bar_left + kBarWidth + 7 << "' y1='" << y << "' y2='"
         << y << "'/><text class='cbar-label' x='" << bar_left + kBarWidth + 10 << "' y='" << y
         << "' dominant-baseline='central'>" << clip << fmt(labels[i], 3) << "</text>";
    }
  }
  os << "</svg><img class='heatmap' alt='weights of batch " << s.b << " head " << s.h << (log ? " (log)" : "")
     << "' width='" << w << "' height='" << h << "' src='" << heatmap_uri(s, scale, px) << "'>";
  if (scale.top > 0) {
    os << "<img class='colourbar' alt='colour bar, " << (log ? "log" : "linear") << " scale' data-top='" << fmt(scale.top, 17)
       << "' style='left:" << bar_left << "px' width='" << kBarWidth << "' height='" << bar_h << "' src='"
       << colourbar_uri(scale, kBarWidth, bar_h) << "'>";
  }
  os << "</div></figure>";
  return os.str();
}

}  // namespace

double ColourScale::position(double w) const { return log ? (std::log10(w / top) + 5) / 5 : w / top; }

double ColourScale::value_at(double p) const { return log ? top * std::pow(10.0, 5 * (p - 1)) : top * p; }

std::vector<double> ColourScale::labels() const {
  if (log) return {top * 1e-5, top * 1e-4, top * 1e-3, top * 1e-2, top * 1e-1, top};
  return {0.0, top / 4, top / 2, 3 * top / 4, top};
}

ColourScale colour_scale(const HeadSummary& s, bool log) {
  ColourScale scale;
  scale.log = log;
  std::vector<double> cells;
  for (double w : s.grid) {
    if (w > 0) cells.push_back(w);  // not the grey ones (-1, NaN)
  }
  if (cells.empty()) return scale;
  // log: the largest; linear: nearest rank ceil(0.99 n) of n, counted from 1.
  const size_t at = log ? cells.size() - 1 : (cells.size() * 99 + 99) / 100 - 1;
  std::nth_element(cells.begin(), cells.begin() + static_cast<std::ptrdiff_t>(at), cells.end());
  scale.top = cells[at];
  return scale;
}

std::array<unsigned char, 3> cell_colour(const ColourScale& scale, double w) {
  if (!(w >= 0)) return {kZeroGrey, kZeroGrey, kZeroGrey};
  return viridis(scale.position(w));
}

std::vector<Tick> axis_ticks(int64_t n, int64_t cells, int px) {
  std::vector<Tick> ticks;
  if (n <= 0 || cells <= 0) return ticks;
  const double pixels = static_cast<double>(cells) * px;
  const auto fits = [&](int64_t step) {  // at most 6 ticks, 40 pixels apart on average
    return (n - 1) / step <= 5 && static_cast<double>(step) * pixels / static_cast<double>(n) >= 40;
  };
  int64_t step = 1;
  for (int64_t decade = 1; !fits(step); decade *= 10) {
    for (int64_t m : {1, 2, 5}) {
      if (fits(step = m * decade)) break;
    }
  }
  for (int64_t i = 0; i < n; i += step) {
    // Cell c holds the run first .. next - 1: the i with floor(i · cells / n) = c.
    const int64_t c = run_of(i, cells, n), first = run_first(c, cells, n), next = run_first(c + 1, cells, n);
    const double share = (static_cast<double>(i - first) + 0.5) / static_cast<double>(next - first);
    ticks.push_back({i, px * (static_cast<double>(c) + share)});
  }
  return ticks;
}

std::vector<unsigned char> encode_png(const std::vector<unsigned char>& rgb, int width, int height) {
  std::vector<unsigned char> out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) {
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error("libpng: cannot create a writer");
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error("libpng: encoding failed");
  }
  png_set_write_fn(png, &out, write_to_vector, nullptr);
  png_set_IHDR(png, info, static_cast<png_uint_32>(width), static_cast<png_uint_32>(height), 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < height; ++y) {
    png_write_row(png, const_cast<png_bytep>(rgb.data() + static_cast<size_t>(y) * static_cast<size_t>(width) * 3));
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

std::function<void(int64_t, int64_t)> terminal_progress() {
  if (!isatty(STDERR_FILENO)) return nullptr;
  return [](int64_t done, int64_t total) {
    const int width = 30, filled = static_cast<int>(width * done / (total ? total : 1));
    std::fprintf(stderr, "\rinspect [%s%s] %lld/%lld heads", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), ' ').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total));
    if (done == total) std::fputc('\n', stderr);
  };
}

std::vector<HeadSummary> summarize(const Request& r) {
  if (r.topk < 0 || r.topk > 32) throw sdpa::Error("topk must be in [0, 32], got " + std::to_string(r.topk));
  if (r.cells < 1) throw sdpa::Error("cells must be at least 1, got " + std::to_string(r.cells));
  sdpa::Options o = r.options;
  o.dropout_p = 0;
  sdpa::validate(r.inputs, o);  // errors name the whole call's arguments, not one head's views
  const Dims d = dims_of(r.inputs);
  std::vector<HeadSummary> heads;
  const int64_t total = std::min(d.B * d.Hq, std::max<int64_t>(0, r.max_heads));
  for (int64_t x = 0; x < total; ++x) {
    heads.push_back(summarize_head(r, d, x / d.Hq, x % d.Hq));
    if (r.progress) r.progress(x + 1, total);
  }
  return heads;
}

std::string report_html(const Request& r) {
  const std::vector<HeadSummary> heads = summarize(r);
  const Dims d = dims_of(r.inputs);
  const double scale = r.options.scale ? *r.options.scale : 1.0 / std::sqrt(static_cast<double>(d.Dk));
  const char* causal = r.options.causal == sdpa::Causal::kNone ? "none"
                       : r.options.causal == sdpa::Causal::kBottomRight ? "bottom_right" : "top_left";
  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" << escape(r.title) << "</title>\n<style>"
     << "body{font-family:sans-serif;margin:24px;color:#222} table{border-collapse:collapse;margin:8px 0}"
     << "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} .maps{display:flex;gap:32px;flex-wrap:wrap}"
     << "figure{margin:8px 0} .axis{font-size:12px;color:#555} img{image-rendering:pixelated;border:1px solid #888}"
     << ".flag{color:#b00;font-weight:bold} td.zero{color:#999} .plot{position:relative}"
     << ".plot svg{position:absolute;left:0;top:0;overflow:visible} .plot img{position:absolute;top:0}"
     << ".plot img.heatmap{left:" << kAxisLeft << "px} .plot text{font-size:11px;fill:#444} .plot line{stroke:#666}"
     << "</style></head><body>\n"
     << "<h1>" << escape(r.title) << "</h1>\n<table>"
     << "<tr><th>q</th><td>" << r.inputs.q.shape_string() << ' ' << sdpa::dtype_name(r.inputs.q.dtype) << "</td></tr>"
     << "<tr><th>k</th><td>" << r.inputs.k.shape_string() << "</td></tr><tr><th>v</th><td>" << r.inputs.v.shape_string()
     << "</td></tr><tr><th>mask</th><td>" << (r.inputs.mask ? r.inputs.mask->shape_string() : "none") << "</td></tr>"
     << "<tr><th>scale</th><td>" << fmt(scale, 8) << "</td></tr><tr><th>causal</th><td>" << causal << "</td></tr>"
     << "<tr><th>window</th><td>" << r.options.window.left << ", " << r.options.window.right << "</td></tr>"
     << "<tr><th>heads drawn</th><td>" << heads.size() << " of " << d.B * d.Hq << "</td></tr></table>\n"
     << "<p class='axis'>Heatmaps: query rows down, keys across, ticks at query and key indices; viridis "
     << "from 0 (dark) to the 99th percentile of the head's cells (yellow, and every cell above it), or on "
     << "the log10 scale over the five decades below the largest cell (dark, and every cell below them), as "
     << "each colour bar shows; grey: every weight of the cell is exactly 0 (blocked keys, or underflowed), "
     << "or NaN. "
     << (d.Nq > r.cells || d.Nk > r.cells ? "Each cell averages a block of weights (the input is larger than the picture); "
                                            "a tick marks its index's place in its cell's block."
                                          : "One cell per weight.")
     << " Flags: near-uniform = mean normalised entropy >= 0.9, near-one-hot = mean max weight >= 0.9.</p>\n";
  for (const HeadSummary& s : heads) {
    os << "<section class='head' id='head-" << s.b << '-' << s.h << "'><h2>batch " << s.b << ", head " << s.h;
    if (!s.flag.empty()) os << " <span class='flag'>" << s.flag << "</span>";
    os << "</h2>\n<table><tr><th>row sum min</th><td>" << fmt(s.row_sum_min, 8) << "</td><th>row sum max</th><td>"
       << fmt(s.row_sum_max, 8) << "</td></tr><tr><th>entropy mean</th><td>" << fmt(mean_of(s.entropy))
       << "</td><th>normalised mean</th><td>" << fmt(mean_of(s.entropy_normalized)) << "</td></tr><tr><th>max weight mean</th><td>"
       << fmt(mean_of(s.max_weight)) << "</td><th>picture</th><td>" << s.rows << " x " << s.cols << " cells</td></tr></table>\n";
    if (s.rows > 0 && s.cols > 0) {
      os << "<div class='maps'>";
      for (bool log : {false, true}) os << heatmap_figure(s, d, log);
      os << "</div>\n";
    }
    // Entropy up to its largest possible value, log(Nk) (every key equally weighted).
    const double h_top = d.Nk > 1 ? std::log(static_cast<double>(d.Nk)) : 1.0;
    os << curve_svg("entropy (nats)", s.entropy, h_top) << curve_svg("max weight", s.max_weight, 1.0);
    if (d.Nq <= 16 && d.Nk <= 16 && s.rows == d.Nq && s.cols == d.Nk) {  // small: the weights themselves
      os << "<table class='weights'><tr><th>query \\ key</th>";
      for (int64_t j = 0; j < d.Nk; ++j) os << "<th>" << j << "</th>";
      os << "<th>sum</th></tr>";
      for (int64_t i = 0; i < d.Nq; ++i) {
        os << "<tr><th>" << i << "</th>";
        double sum = 0;
        for (int64_t j = 0; j < d.Nk; ++j) {
          const double w = s.grid[static_cast<size_t>(i * d.Nk + j)];
          sum += std::max(w, 0.0);
          os << (w < 0 ? "<td class='zero'>0</td>" : "<td>" + fmt(w, 6) + "</td>");
        }
        os << "<td>" << fmt(sum, 6) << "</td></tr>";
      }
      os << "</table>\n";
    }
    if (r.topk > 0) {  // top keys of up to 16 rows, evenly spaced
      os << "<table class='topk'><tr><th>query</th><th>entropy</th><th>top keys (weight)</th></tr>";
      const int64_t shown = std::min<int64_t>(16, d.Nq);
      for (int64_t x = 0; x < shown; ++x) {
        const int64_t i = shown == 1 ? 0 : x * (d.Nq - 1) / (shown - 1);
        os << "<tr><th>" << i << "</th><td>" << fmt(s.entropy[static_cast<size_t>(i)]) << "</td><td style='text-align:left'>";
        for (int64_t t = 0; t < r.topk; ++t) {
          const int64_t j = s.topk_indices[static_cast<size_t>(i * r.topk + t)];
          if (j >= 0) os << j << " (" << fmt(s.topk_weights[static_cast<size_t>(i * r.topk + t)], 3) << ") ";
        }
        os << "</td></tr>";
      }
      os << "</table>\n";
    }
    os << "</section>\n";
  }
  os << "</body></html>\n";
  return os.str();
}

}  // namespace sdpa_inspect
