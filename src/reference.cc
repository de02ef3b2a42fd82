#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "flash/row_stats.h"

namespace sdpa::internal {

template <typename Acc>
void score_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* s, ScoresStage stage) {
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const Acc scale = static_cast<Acc>(p.scale);
  const int64_t kvh = h / p.group;
  // Scores s_j = Σ_d (q_id · scale) · k_jd + bias_ij (the scale applied to q first, as in
  // every kernel), -inf outside causal/window and where the mask blocks (whatever the dot
  // product). A value beyond the range of the inputs' dtype (q · scale, a product, the
  // score) is ±inf, and one too small for it is ±0, as in the kernels that compute in it:
  // float64 holds what float32 cannot (1e-50 · inf would be inf here, but 0 · inf = NaN
  // there). Only the ends of the range: the precision stays float64's. (Partial sums are
  // not rounded: they may stay finite here where float32's overflow.)
  const bool masked = stage == ScoresStage::kBiased || stage == ScoresStage::kFinal;
  const KeyRange range = masked ? p.key_range(b, i) : KeyRange{0, p.keys_of(b)};
  const auto in_range = [&p](Acc x) { return p.in_compute_range(x); };
  std::vector<Acc> q_scaled(static_cast<size_t>(p.Dk));  // q · scale, the same for every key
  for (int64_t d = 0; d < p.Dk; ++d) q_scaled[static_cast<size_t>(d)] = in_range(p.q.load<Acc>(b, h, i, d) * scale);
  for (int64_t j = 0; j < p.Nk; ++j) {
    s[j] = neg_inf;
    // A key the block mask blocks is not read (the kernels' overflow fallback, finish_block,
    // calls this, and the header promises blocked tiles untouched: fuzz finding F18).
    if (j < range.begin || j >= range.end || (masked && !p.block_allows(b, h, i, j))) continue;
    Acc dot = 0;
    for (int64_t d = 0; d < p.Dk; ++d) dot += in_range(q_scaled[static_cast<size_t>(d)] * p.k.load<Acc>(b, kvh, j, d));
    if (stage == ScoresStage::kFinal) {
      s[j] = in_range(p.score(dot, b, h, i, j));  // softcap, ALiBi and the mask's bias
    } else if (stage == ScoresStage::kBiased) {
      const Acc alibi = p.has_alibi() ? p.alibi_bias<Acc>(b, h, i, j) : Acc(0);
      s[j] = in_range(with_bias(in_range(dot + alibi), p.mask_bias<Acc>(b, h, i, j)));
    } else if (stage == ScoresStage::kSoftcapped) {
      s[j] = in_range(p.capped(in_range(dot)));
    } else {
      s[j] = in_range(dot);
    }
  }
}

template <typename Acc>
void write_scores(const Problem& p) {
  std::vector<Acc> row(static_cast<size_t>(p.Nk));
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.Hq; ++h) {
      for (int64_t i = 0; i < p.Nq; ++i) {
        score_row(p, b, h, i, row.data(), p.scores_stage);
        for (int64_t j = 0; j < p.Nk; ++j) p.scores->store(b, h, i, j, row[static_cast<size_t>(j)]);
      }
    }
  }
}

template <typename Acc>
Acc softmax_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* prob, Acc* scores) {
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  // 1. Scores, -inf where blocked (score_row).
  score_row(p, b, h, i, prob);
  Acc row_max = neg_inf;
  bool nan = false;
  for (int64_t j = 0; j < p.Nk; ++j) {
    row_max = std::max(row_max, prob[j]);
    nan |= std::isnan(prob[j]);
  }
  // 2. Stable softmax: subtract the row max (shifted_exp: a max of +inf shares the weight among
  //    the +inf keys). A row with no allowed key stays all zero. A NaN score makes the row NaN:
  //    its sum and lse, and its weights at every key it does not block (blocked keys stay 0).
  //    A sink is one more term of the sum, with no value row: the max and the sum include it.
  if (scores != nullptr) std::copy(prob, prob + p.Nk, scores);
  const Acc sink = p.has_sinks() ? p.in_compute_range(p.sink<Acc>(h)) : neg_inf;
  if (row_max == neg_inf && !nan) {
    std::fill(prob, prob + p.Nk, Acc(0));
    return sink;  // -inf without a sink
  }
  Acc sum = 0;
  if (p.has_sinks() && !nan) {
    row_max = std::max(row_max, sink);
    sum = shifted_exp(sink, row_max);
  }
  for (int64_t j = 0; j < p.Nk; ++j) {
    prob[j] = prob[j] == neg_inf ? Acc(0) : nan ? std::numeric_limits<Acc>::quiet_NaN() : shifted_exp(prob[j], row_max);
    sum += prob[j];
  }
  const Acc inv_sum = Acc(1) / sum;
  for (int64_t j = 0; j < p.Nk; ++j) {
    if (prob[j] != 0) prob[j] *= inv_sum;  // 0 stays 0 when the sum is NaN
  }
  return row_max + std::log(sum);
}

// Options::precision kFast's row (Acc = float, Problem::round_p), the naive algorithm that
// rounds what the fused kernel rounds: p~_j = exp(s_j - m) rounded to q's 16-bit type (m the
// row's max, the sink's logit included), l = Σ_j p~_j (+ exp(sink - m), unrounded), out_i =
// Σ_j p~_j · z_j · v_j / l. s: the row's scores (-inf blocked), at least one finite and none NaN.
// Returns lse = m + log(l), the normaliser used.
template <typename Acc>
Acc attend_row_rounded(const Problem& p, int64_t b, int64_t h, int64_t i, const Acc* s, Acc* acc) {
  Acc m = *std::max_element(s, s + p.Nk);
  const Acc sink = p.has_sinks() ? p.in_compute_range(p.sink<Acc>(h)) : -std::numeric_limits<Acc>::infinity();
  m = std::max(m, sink);
  Acc l = p.has_sinks() ? shifted_exp(sink, m) : Acc(0);
  const int64_t kvh = h / p.group;
  for (int64_t j = 0; j < p.Nk; ++j) {
    if (s[j] == -std::numeric_limits<Acc>::infinity()) continue;
    const Acc pj = rounded_to_16bit(p.dtype, shifted_exp(s[j], m));
    l += pj;
    const Acc w = pj * p.dropout.factor<Acc>(b, h, i, j);
    if (w == 0) continue;
    for (int64_t d = 0; d < p.Dv; ++d) acc[d] += w * p.v.load<Acc>(b, kvh, j, d);
  }
  for (int64_t d = 0; d < p.Dv; ++d) acc[d] /= l;
  return m + std::log(l);
}

template <typename Acc, typename Out>
Acc attend_row(const Problem& p, int64_t b, int64_t h, int64_t i, Acc* prob, Out* out_row, Acc* scores) {
  // kFast's rounding needs the row's scores; a row with no allowed key or a NaN score is the
  // same in either mode (out 0 or NaN).
  const bool rounded = !std::is_same_v<Acc, double> && p.round_p;
  std::vector<Acc> own_scores(rounded && scores == nullptr ? static_cast<size_t>(p.Nk) : 0);
  if (rounded && scores == nullptr) scores = own_scores.data();
  Acc lse = softmax_row(p, b, h, i, prob, scores);
  std::vector<Acc> acc(static_cast<size_t>(p.Dv), Acc(0));
  const bool finite_row = rounded && std::any_of(scores, scores + p.Nk, [](Acc x) { return x > -std::numeric_limits<Acc>::infinity(); }) &&
                          std::none_of(scores, scores + p.Nk, [](Acc x) { return std::isnan(x); });
  if (finite_row) {
    lse = attend_row_rounded(p, b, h, i, scores, acc.data());
  } else {
    // 3. out_i = sum_j w_ij v_j, the weights after dropout (w itself when it is off), over the
    //    keys whose weight is not 0: a blocked, dropped or underflowed key adds nothing, even a
    //    NaN in its value row.
    const int64_t kvh = h / p.group;
    for (int64_t j = 0; j < p.Nk; ++j) {
      const Acc w = prob[j] * p.dropout.factor<Acc>(b, h, i, j);
      if (w == 0) continue;
      for (int64_t d = 0; d < p.Dv; ++d) acc[d] += w * p.v.load<Acc>(b, kvh, j, d);
    }
  }
  for (int64_t d = 0; d < p.Dv; ++d) out_row[d] = static_cast<Out>(acc[d]);
  return lse;
}

// Outputs::stats of row (b, h, i), straight from the definitions in the header: its weights w
// and scores s (-inf: blocked).
template <typename Acc>
void row_stats(const Problem& p, int64_t b, int64_t h, int64_t i, const Acc* w, const Acc* s) {
  const Acc nan_value = std::numeric_limits<Acc>::quiet_NaN();
  int64_t allowed = 0, argmax = -1;
  bool nan = false;
  std::vector<int64_t> keys;  // the allowed keys
  for (int64_t j = 0; j < p.Nk; ++j) {
    nan |= std::isnan(s[j]);
    if (!(s[j] > -std::numeric_limits<Acc>::infinity())) continue;
    ++allowed;
    keys.push_back(j);
    if (argmax < 0 || s[j] > s[argmax]) argmax = j;
  }
  Acc entropy = 0;
  for (int64_t j = 0; j < p.Nk; ++j) {
    if (w[j] > 0) entropy -= w[j] * std::log(w[j]);
  }
  Acc normalized = allowed > 1 ? entropy / std::log(static_cast<Acc>(allowed)) : Acc(0);
  Acc max_weight = argmax < 0 ? Acc(0) : w[argmax];
  // Top k: the largest scores first, ties to the lower key (a stable sort of increasing keys).
  std::stable_sort(keys.begin(), keys.end(), [&](int64_t x, int64_t y) { return s[x] > s[y]; });
  if (nan) {
    entropy = normalized = max_weight = nan_value;
    argmax = -1;
  }
  p.stats.store_row(b, h, i, allowed, entropy, normalized, max_weight, argmax, [&](int64_t r) {
    const int64_t j = !nan && r < static_cast<int64_t>(keys.size()) ? keys[static_cast<size_t>(r)] : -1;
    return std::pair<int64_t, Acc>{j, nan ? nan_value : j < 0 ? Acc(0) : w[j]};
  });
}

template <typename Acc>
void materialized_attention(const Problem& p) {
  std::vector<Acc> prob(static_cast<size_t>(p.Nk)), scores(p.stats.in_pass() ? static_cast<size_t>(p.Nk) : 0);
  std::vector<Acc> out_row(static_cast<size_t>(p.Dv));
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.Hq; ++h) {
      for (int64_t i = 0; i < p.Nq; ++i) {
        const Acc lse = attend_row(p, b, h, i, prob.data(), out_row.data(), p.stats.in_pass() ? scores.data() : nullptr);
        if (p.stats.in_pass()) row_stats(p, b, h, i, prob.data(), scores.data());
        if (p.weights) {
          for (int64_t j = 0; j < p.Nk; ++j) p.weights->store(b, h, i, j, prob[j]);  // before dropout
        }
        if (const auto& pw = p.stats.pooled_weights; pw && pw->shape[3] > 0) {  // the weights' sums over runs of keys
          std::vector<Acc> sums(static_cast<size_t>(pw->shape[3]), Acc(0));
          for (int64_t j = 0; j < p.Nk; ++j) sums[static_cast<size_t>(pooled_run(j, pw->shape[3], p.Nk))] += prob[j];
          for (int64_t c = 0; c < pw->shape[3]; ++c) pw->store(b, h, i, c, sums[static_cast<size_t>(c)]);
        }
        for (int64_t d = 0; d < p.Dv; ++d) p.out.store(b, h, i, d, out_row[d]);
        if (p.lse) p.lse->store(b, h, i, 0, lse);
      }
    }
  }
}

void lse_of_biases(const Problem& p) {
  const double neg_inf = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.Hq; ++h) {
      for (int64_t i = 0; i < p.Nq; ++i) {
        const KeyRange range = p.key_range(b, i);
        double lse = neg_inf;
        if (!range.empty() && !p.biases_constant_along_keys()) {
          // The scores vary along the keys (the mask's row exists in memory; ALiBi's distances;
          // the block mask's blocks): walk them.
          double row_max = lse, sum = 0;
          for (int64_t j = range.begin; j < range.end; ++j) row_max = std::max(row_max, p.score(0.0, b, h, i, j));
          for (int64_t j = range.begin; j < range.end && row_max > lse; ++j) {
            sum += shifted_exp(p.score(0.0, b, h, i, j), row_max);
          }
          if (row_max > lse) lse = row_max + std::log(sum);
        } else if (!range.empty()) {
          // One score for every key of the row: lse = score + log(number of keys).
          const double s = p.score(0.0, b, h, i, range.begin);
          if (s != lse) lse = s + std::log(static_cast<double>(range.end - range.begin));
        }
        if (p.has_sinks()) {  // log(exp(lse) + exp(sink))
          const double sink = p.sink<double>(h), m = std::max(lse, sink);
          lse = m + std::log(shifted_exp(lse, m) + shifted_exp(sink, m));
        }
        p.lse->store(b, h, i, 0, lse);
      }
    }
  }
}

template <typename T>
void stats_of_constant_rows(const Problem& p) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t k = std::max<int64_t>(p.stats.topk, 1);
  std::vector<T> reals(static_cast<size_t>(LaneStats<T>::reals_size(1, k)));
  std::vector<int64_t> ints(static_cast<size_t>(LaneStats<T>::ints_size(1, k)));
  const LaneStats<T> ls{1, k, reals.data(), ints.data()};
  const std::optional<View4>& pooled = p.stats.pooled_weights;
  const int64_t G = pooled ? pooled->shape[3] : 0;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.Hq; ++h) {
      for (int64_t i = 0; i < p.Nq; ++i) {
        const KeyRange range = p.key_range(b, i);
        const T s = range.empty() ? neg_inf : p.score(T(0), b, h, i, range.begin);
        ls.begin();
        T m = 0, l = 0;  // write_row_stats' row with no allowed key
        if (s > neg_inf) {
          const int64_t n = range.end - range.begin;
          ls.allowed()[0] = n;
          ls.argmax()[0] = range.begin;
          for (int64_t r = 0; r < std::min(k, n); ++r) {
            ls.top_s(0)[r] = s;
            ls.top_i(0)[r] = range.begin + r;
          }
          m = s;
          l = static_cast<T>(n);  // Σ exp(s - m) over the n keys; t = Σ exp(s - m)·(s - m) = 0
        }
        const T w = write_row_stats(p, b, h, i, m, l, p.has_sinks() ? p.sink<T>(h) : neg_inf, ls, 0);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t c = std::min(range.end, pooled_run_first(g + 1, G, p.Nk)) -
                            std::max(range.begin, pooled_run_first(g, G, p.Nk));
          pooled->store(b, h, i, g, c > 0 && s > neg_inf ? static_cast<T>(static_cast<double>(c) * static_cast<double>(w)) : T(0));
        }
      }
    }
  }
}

template void stats_of_constant_rows<float>(const Problem& p);
template void stats_of_constant_rows<double>(const Problem& p);
template void score_row<float>(const Problem&, int64_t, int64_t, int64_t, float*, ScoresStage);
template void score_row<double>(const Problem&, int64_t, int64_t, int64_t, double*, ScoresStage);
template float softmax_row<float>(const Problem&, int64_t, int64_t, int64_t, float*, float*);
template double softmax_row<double>(const Problem&, int64_t, int64_t, int64_t, double*, double*);
template float attend_row<float, float>(const Problem&, int64_t, int64_t, int64_t, float*, float*, float*);
template double attend_row<double, double>(const Problem&, int64_t, int64_t, int64_t, double*, double*, double*);
template void materialized_attention<float>(const Problem& p);
template void write_scores<float>(const Problem& p);
template void write_scores<double>(const Problem& p);
template void materialized_attention<double>(const Problem& p);

}  // namespace sdpa::internal
