// `sdpa demo`: the toy head of seed 000 (two queries, three keys, d_k = d_v = 2) computed by
// sdpa::attention in float64, with every intermediate printed so it can be checked by hand.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "sdpa/attention.h"

namespace sdpa_cli {
namespace {

std::string fixed(double x, int decimals) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(decimals) << x;
  return s.str();
}

// Prints a rows x cols row-major matrix NumPy-style, every column right-aligned to the widest
// entry, e.g. "[[1.0 0.0]\n [0.0 1.0]]". notes[i], when given, is printed after row i.
void print_matrix(std::ostream& os, const std::string& title, const double* m, int rows, int cols, int decimals,
                  const std::vector<std::string>& notes = {}) {
  std::vector<std::string> cells;
  size_t width = 0;
  for (int i = 0; i < rows * cols; ++i) {
    cells.push_back(fixed(m[i], decimals));
    width = std::max(width, cells.back().size());
  }
  os << title << " (" << rows << ", " << cols << "):\n";
  for (int r = 0; r < rows; ++r) {
    os << (r == 0 ? "[[" : " [");
    for (int c = 0; c < cols; ++c) os << (c ? " " : "") << std::setw(static_cast<int>(width)) << cells[r * cols + c];
    os << (r == rows - 1 ? "]]" : notes.empty() ? "]" : "] ");  // keeps the notes aligned
    if (r < static_cast<int>(notes.size())) os << "   " << notes[r];
    os << '\n';
  }
}

void print_vector(std::ostream& os, const std::string& title, const double* x, int n, int decimals) {
  os << title << " (" << n << ",):\n[";
  for (int i = 0; i < n; ++i) os << (i ? " " : "") << fixed(x[i], decimals);
  os << "]\n";
}

}  // namespace

CLI::App* add_demo_command(CLI::App& app) {
  return app.add_subcommand("demo", "Show attention on a 2-query, 3-key toy head, step by step (float64)");
}

void demo_command(std::ostream& os) {
  constexpr int Nq = 2, Nk = 3, Dk = 2, Dv = 2;
  double q[Nq * Dk] = {1, 0,  //
                       0, 1};
  double k[Nk * Dk] = {1, 0,  //
                       1, 1,  //
                       0, 1};
  double v[Nk * Dv] = {1, 0,  //
                       0, 2,  //
                       1, 1};
  double out[Nq * Dv], weights[Nq * Nk], lse[Nq];
  const double scale = 1.0 / std::sqrt(2.0);

  using sdpa::DType, sdpa::TensorView;
  sdpa::Inputs inputs{TensorView::contiguous(q, DType::kFloat64, {Nq, Dk}),
                      TensorView::contiguous(k, DType::kFloat64, {Nk, Dk}),
                      TensorView::contiguous(v, DType::kFloat64, {Nk, Dv}), std::nullopt};
  sdpa::Outputs outputs{TensorView::contiguous(out, DType::kFloat64, {Nq, Dv}),
                        TensorView::contiguous(weights, DType::kFloat64, {Nq, Nk}),
                        TensorView::contiguous(lse, DType::kFloat64, {Nq})};
  sdpa::attention(inputs, outputs);  // the default scale, 1/sqrt(Dk): `scale` is for display

  // The scores are not an output of the library; recomputed here only to be shown.
  double scores[Nq * Nk];
  for (int i = 0; i < Nq; ++i) {
    for (int j = 0; j < Nk; ++j) {
      double dot = 0;
      for (int d = 0; d < Dk; ++d) dot += q[i * Dk + d] * k[j * Dk + d];
      scores[i * Nk + j] = dot * scale;
    }
  }
  std::vector<std::string> row_sums;
  for (int i = 0; i < Nq; ++i) {
    double sum = 0;
    for (int j = 0; j < Nk; ++j) sum += weights[i * Nk + j];
    row_sums.push_back("row sum " + fixed(sum, 6));
  }

  os << "Toy attention head (seed 000) through sdpa::attention in float64, scale = 1/sqrt(2) = " << fixed(scale, 6)
     << "\n\n";
  print_matrix(os, "q", q, Nq, Dk, 1);
  print_matrix(os, "k", k, Nk, Dk, 1);
  print_matrix(os, "v", v, Nk, Dv, 1);
  print_matrix(os, "scores = q @ k.T * scale", scores, Nq, Nk, 6);
  print_matrix(os, "weights = softmax(scores, axis=1)", weights, Nq, Nk, 6, row_sums);
  print_matrix(os, "out = weights @ v", out, Nq, Dv, 6);
  print_vector(os, "lse = log(sum(exp(scores), axis=1))", lse, Nq, 6);
}

}  // namespace sdpa_cli
