// `sdpa inspect`: reads a call as `sdpa run` does (or takes seed 000's toy head with --demo)
// and writes inspect.h's HTML report, with a progress bar on a terminal.
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

#include "commands.h"
#include "inspect.h"

namespace sdpa_cli {

CLI::App* add_inspect_command(CLI::App& app, InspectOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Write an HTML report of attention's weights per head: heatmaps, entropy, top keys (any length)");
  add_call_options(cmd, o, /*required=*/false);
  cmd->add_flag("--demo", o.demo, "Inspect seed 000's toy head (2 queries, 3 keys) instead of --q/--k/--v");
  cmd->add_option("-o,--out", o.out, "The report (one self-contained HTML file)")->type_name("FILE")->capture_default_str();
  cmd->add_option("--topk", o.topk, "Top keys listed per query row")->check(CLI::Range(0, 32))->capture_default_str();
  cmd->add_option("--cells", o.cells, "Heatmap cells per axis: one per weight up to this length, block averages above")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  cmd->add_option("--max-heads", o.max_heads, "Heads drawn, in (batch, head) order")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_flag("!--no-progress", o.progress, "No progress bar (it is shown only on a terminal anyway)");
  cmd->footer(std::string("Statistics and pictures come from the fused kernel: memory O(Nq * cells) per head.\n") +
              kDtypesFooter);
  return cmd;
}

void inspect_command(const InspectOptions& o) {
  sdpa_inspect::Request request;
  // The toy head of seed 000 (as `sdpa demo`): float64, 2 queries, 3 keys, d = 2.
  double q[4] = {1, 0, 0, 1}, k[6] = {1, 0, 1, 1, 0, 1}, v[6] = {1, 0, 0, 2, 1, 1};
  LoadedCall call;
  if (o.demo) {
    if (!o.q.empty() || !o.k.empty() || !o.v.empty()) throw std::runtime_error("--demo takes no --q, --k or --v");
    using sdpa::DType, sdpa::TensorView;
    request.inputs = {TensorView::contiguous(q, DType::kFloat64, {2, 2}), TensorView::contiguous(k, DType::kFloat64, {3, 2}),
                      TensorView::contiguous(v, DType::kFloat64, {3, 2}), std::nullopt};
    request.title = "sdpa inspect: seed 000's toy head";
  } else {
    if (o.q.empty() || o.k.empty() || o.v.empty()) throw std::runtime_error("--q, --k and --v are required (or --demo)");
    call = load_call(o);
    request.inputs = call.inputs;
    request.options = call.options;
    request.title = "sdpa inspect: " + call.files;
  }
  request.topk = o.topk;
  request.cells = o.cells;
  request.max_heads = o.max_heads;
  if (o.progress) request.progress = sdpa_inspect::terminal_progress();
  std::string html;
  try {
    html = sdpa_inspect::report_html(request);
  } catch (const sdpa::Error& e) {
    if (o.demo) throw;
    throw call.with_files(e);
  }
  std::ofstream file(o.out, std::ios::binary);
  if (!file || !(file << html) || !file.flush()) throw std::runtime_error("cannot write " + o.out);
}

}  // namespace sdpa_cli
