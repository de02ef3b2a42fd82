// The fused forward kernel's scheduling, compiled once per SIMD target (included by
// forward_f32.cc and forward_f64.cc through hwy/foreach_target.h): FlashMany and Flash cut the
// problems into units (groups of blocks and key chunks: flash_plan.h's Plan), run each
// (forward_block-inl.h's RunBlocks, or decode-inl.h's DecodeBlock for few rows per kv head),
// merge split key chunks and finish the rows. FlashAttention-2 online softmax over key tiles;
// the Nq×Nk score matrix never exists, only one (kTileKeys × lanes-block) tile per thread.
// The pieces, by concern: products-inl.h (the outer products), bf16_path-inl.h (the bfloat16
// dot path), query_block-inl.h (a block's state, packed queries and scored tiles; the backward's
// dq pass shares it), tile_stats-inl.h (Outputs::stats per tile), forward_block-inl.h
// (BlockTile, RunBlocks, WriteWeights).
//
// Layout: "queries along lanes". A block holds up to QV vectors' worth of query rows (Mq =
// QV·Lanes) of one kv head: for GQA the rows of all query heads that read this kv head,
// r = i·group + g. The block's queries are packed transposed once, qt[d][lane], so that
//   scores  st[j][lane] = Σ_d k[j][d] · qt[d][lane]      (broadcast k[j][d], FMA a q vector)
//   output  ot[e][lane] += Σ_j v[j][e] · st[j][lane]      (broadcast v[j][e], FMA a p vector)
// Both products are register-blocked outer products that read k and v rows in place (no
// transpose, no packing of K/V), and the softmax runs down columns, i.e. lane-wise: its max
// and sum are plain vertical Max/Add with no horizontal reductions.

#if defined(SDPA_FLASH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SDPA_FLASH_INL_H_
#undef SDPA_FLASH_INL_H_
#else
#define SDPA_FLASH_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "flash/bf16_path-inl.h"
#include "flash/decode-inl.h"
#include "flash/flash_plan.h"
#include "flash/forward_block-inl.h"
#include "flash/row_stats.h"
#include "flash/rows-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernel_path.h"
#include "problem.h"

HWY_BEFORE_NAMESPACE();
namespace sdpa::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One problem of a FlashMany call: its plan, its instruction path, and the (ot, m, l, bad)
// of each block and key chunk when its keys are split (merged after all chunks ran).
template <typename T>
struct Job {
  const Problem* p = nullptr;
  Plan plan;
  KernelPath dot = KernelPath::kSimd;
  bool pv_pairs = false;  // kFast's p·V with vdpbf16ps (Scratch::pv_pairs)
  bool pv_amx = false;    // ... on AMX tiles (Scratch::pv_amx)
  size_t mq = 0, partial_size = 0;
  std::vector<T> partial;
  // The statistics' lane states (LaneStats' two arrays) of each block and chunk, when asked for.
  std::vector<T> partial_stat_reals;
  std::vector<int64_t> partial_stat_ints;
  int64_t first_unit = 0, first_merge = 0;  // this job's units and merged blocks in the call's numbering
  // What a thread's Scratch depends on: jobs that agree share one (a varlen batch: all do).
  bool same_scratch(const Job& o) const {
    return p->Dk == o.p->Dk && p->Dv == o.p->Dv && p->k.dtype == o.p->k.dtype && p->v.dtype == o.p->v.dtype &&
           p->k.paged() == o.p->k.paged() && mq == o.mq && plan.group_blocks == o.plan.group_blocks && dot == o.dot && pv_pairs == o.pv_pairs && pv_amx == o.pv_amx &&
           p->stats.in_pass() == o.p->stats.in_pass() && p->stats.topk == o.p->stats.topk;
  }
};

// Normalises block g of the scratch and writes its rows (and weights, when asked for).
template <typename T, class D>
void FinishBlock(D d, const Job<T>& job, Scratch<T>& s, size_t g, const BlockRows& blk) {
  const Problem& p = *job.p;
  const size_t mq = job.mq;
  const BlockState<T> bs = s.block(g);
  if (bs.stats.reals != nullptr) {  // from the keys' max and sum, before the sink joins them
    for (int64_t lane = 0; lane < blk.rows; ++lane) {
      const LaneRow& r = bs.lanes[lane];
      const T sink = p.has_sinks() ? p.sink<T>(r.h) : -std::numeric_limits<T>::infinity();
      write_row_stats(p, blk.b, r.h, r.i, bs.m[lane], bs.l[lane], sink, bs.stats, lane);
    }
  }
  if (p.has_sinks()) add_sinks(p, bs.lanes, blk.rows, static_cast<int64_t>(mq), bs.ot, bs.m, bs.l);
  finish_block<T>(p, blk, bs.ot, bs.m, bs.l, bs.bad, mq, bs.lanes);
  if (!p.weights && !p.stats.pooled_weights) return;
  // The weights pass reuses the scratch, so it reads m and l from copies.
  std::vector<T> m(bs.m, bs.m + mq), l(bs.l, bs.l + mq);
  if (job.plan.decode) {
    DecodeBlock(d, p, blk, 0, p.Nk, mq, /*weights=*/true, s.decode_q.get(), s.decode_o.get(), s.st.get(),
                s.ot.get(), m.data(), l.data(), s.bad.get(), s.lanes.data(), s.vtile.get());
  } else if (job.plan.qv == 1) {
    WriteWeights<1>(d, p, blk, m.data(), l.data(), s);
  } else {
    WriteWeights<2>(d, p, blk, m.data(), l.data(), s);
  }
}

// Runs the blocks blks[0, count) of one unit over keys [k0, k1), leaving their state in s.
template <typename T, class D>
void RunChunk(D d, const Job<T>& job, const BlockRows* blks, size_t count, int64_t k0, int64_t k1, Scratch<T>& s) {
  const Problem& p = *job.p;
  if (job.plan.decode) {  // one block per group: decode has few rows per kv head
    const LaneStats<T> stats = s.block(0).stats;
    if (stats.reals != nullptr) stats.begin();
    DecodeBlock(d, p, blks[0], k0, k1, job.mq, /*weights=*/false, s.decode_q.get(), s.decode_o.get(), s.st.get(),
                s.ot.get(), s.m.get(), s.l.get(), s.bad.get(), s.lanes.data(), s.vtile.get(), stats);
  } else if (job.plan.qv == 1) {
    RunBlocks<1>(d, p, blks, count, k0, k1, s);
  } else {
    RunBlocks<2>(d, p, blks, count, k0, k1, s);
  }
}

// Copies block g's (ot, m, l, bad) of one key chunk to dst (partial_size elements), and its
// statistics' lane states to reals and ints, for merge_chunks.
template <typename T>
void KeepChunk(const Job<T>& job, Scratch<T>& s, size_t g, T* dst, T* reals, int64_t* ints) {
  const int64_t Dv = job.p->Dv, mq = static_cast<int64_t>(job.mq);
  const BlockState<T> bs = s.block(g);
  std::copy(bs.ot, bs.ot + Dv * mq, dst);
  std::copy(bs.m, bs.m + mq, dst + Dv * mq);
  std::copy(bs.l, bs.l + mq, dst + (Dv + 1) * mq);
  std::copy(bs.bad, bs.bad + kBadClasses * Dv * mq, dst + (Dv + 2) * mq);
  if (bs.stats.reals != nullptr) {
    std::copy(bs.stats.reals, bs.stats.reals + LaneStats<T>::reals_size(bs.stats.mq, bs.stats.k), reals);
    std::copy(bs.stats.ints, bs.stats.ints + LaneStats<T>::ints_size(bs.stats.mq, bs.stats.k), ints);
  }
}

// Merges block blk's key chunks (KeepChunk's, chunk after chunk from partial, reals and ints)
// into scratch block 0 and finishes its rows.
template <typename T, class D>
void MergeAndFinish(D d, const Job<T>& job, Scratch<T>& s, const BlockRows& blk, const T* partial, const T* reals,
                    const int64_t* ints, int64_t chunks) {
  const BlockState<T> bs = s.block(0);
  describe_lanes(*job.p, blk, 0, job.p->Nk, bs.lanes);
  if (bs.stats.reals != nullptr) {  // before merge_chunks overwrites the block's (m, l)
    merge_stats_chunks<T>(partial, reals, ints, chunks, job.p->Dv, bs.stats);
  }
  merge_chunks<T>(partial, chunks, job.p->Dv, job.mq, bs.ot, bs.m, bs.l, bs.bad);
  FinishBlock(d, job, s, 0, blk);
}

// Runs every block of job j's unit u (a group of blocks and a key chunk, or every chunk of one
// block: Plan::local_chunks) and finishes its rows, or keeps its chunk's partial results for
// the merge after all units.
template <typename T, class D>
void RunUnit(D d, Job<T>& job, int64_t u, Scratch<T>& s) {
  const Problem& p = *job.p;
  const Plan& plan = job.plan;
  BlockRows blks[kMaxGroupBlocks];
  const int64_t group = u / plan.unit_chunks(), c = u % plan.unit_chunks();
  const size_t count = plan.group(group, blks);
  const bool stats = s.block(0).stats.reals != nullptr;
  const int64_t rs = stats ? LaneStats<T>::reals_size(s.block(0).stats.mq, s.block(0).stats.k) : 0;
  const int64_t is = stats ? LaneStats<T>::ints_size(s.block(0).stats.mq, s.block(0).stats.k) : 0;
  if (plan.local_chunks) {  // one block (no grouping with chunks): its chunks in key order, merged here
    // Only the chunks [c0, c1) that hold keys of the block's rows: the merge skips a chunk in
    // which a lane saw no key (l = 0), so the others change no bit, and a lane's one chunk
    // merges to its own bits (weight exp(0) = 1). batch_invariance_test checks both.
    const LaneSpan span = describe_lanes(p, blks[0], 0, p.Nk, s.block(0).lanes);
    const int64_t c0 = span.begin / plan.chunk_keys;
    const int64_t c1 = span.begin < span.end ? ceil_blocks(span.end, plan.chunk_keys) : c0 + 1;
    if (c1 - c0 == 1) {
      RunChunk(d, job, blks, 1, c0 * plan.chunk_keys, std::min(p.Nk, (c0 + 1) * plan.chunk_keys), s);
      FinishBlock(d, job, s, 0, blks[0]);
      return;
    }
    s.chunk_partial.resize(static_cast<size_t>(c1 - c0) * job.partial_size);
    s.chunk_stat_reals.resize(static_cast<size_t>((c1 - c0) * rs));
    s.chunk_stat_ints.resize(static_cast<size_t>((c1 - c0) * is));
    for (int64_t cc = c0; cc < c1; ++cc) {
      const int64_t k0 = cc * plan.chunk_keys, k1 = std::min(p.Nk, k0 + plan.chunk_keys), at = cc - c0;
      RunChunk(d, job, blks, 1, k0, k1, s);
      KeepChunk(job, s, 0, s.chunk_partial.data() + at * job.partial_size, s.chunk_stat_reals.data() + at * rs,
                s.chunk_stat_ints.data() + at * is);
    }
    MergeAndFinish(d, job, s, blks[0], s.chunk_partial.data(), s.chunk_stat_reals.data(), s.chunk_stat_ints.data(),
                   c1 - c0);
    return;
  }
  const int64_t k0 = c * plan.chunk_keys, k1 = std::min(p.Nk, k0 + plan.chunk_keys);
  RunChunk(d, job, blks, count, k0, k1, s);
  for (size_t g = 0; g < count; ++g) {
    if (!plan.needs_merge()) {
      FinishBlock(d, job, s, g, blks[g]);
      continue;
    }
    // Keep (ot, m, l, bad) of this block and chunk for the merge.
    const int64_t at = plan.block_index(blks[g]) * plan.chunks + c;
    KeepChunk(job, s, g, job.partial.data() + at * job.partial_size, job.partial_stat_reals.data() + at * rs,
              job.partial_stat_ints.data() + at * is);
  }
}

// Runs n problems (each validated; of compute type T) as one parallel region: the units of all
// of them (groups of blocks and key chunks) share the threads, so a batch of sequences of very
// different lengths (attention_varlen) keeps every thread busy, and pays one region start. Each
// problem's arithmetic is what Flash of it alone does (its plan depends on it alone), so the
// output is bitwise identical for any thread count and any batch it runs in. Each output row is
// written exactly once.
template <typename T>
void FlashMany(const Problem* const* problems, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  std::vector<Job<T>> jobs(n);
  int64_t units = 0, merges = 0;
  double work = 0;
  KernelPath noted = KernelPath::kSimd;
  bool amx = false;  // whether a job's products use AMX tiles (then each thread keeps them configured)
  for (size_t j = 0; j < n; ++j) {
    Job<T>& job = jobs[j];
    const Problem& p = *problems[j];
    job.p = &p;
    job.plan = make_plan(p, N);
    job.mq = job.plan.qv * N;
    // bfloat16 scores with vdpbf16ps: prefill tiles of bfloat16 q and k, where allowed and
    // present. (Not from a paged pool: the instruction reads a tile's keys in place, evenly spaced.)
    // Batch invariant: kSimd everywhere, as decode steps and paged prefill (which cannot take the
    // instruction) must give a row the bits of a dense prefill's.
    job.dot = job.plan.decode || p.batch_invariant || !bf16_dot_scale_ok(p.scale) || p.k.paged() ? KernelPath::kSimd
                                                                            : Bf16DotPath<T>({p.q.dtype, p.k.dtype});
    // kFast's p·V with vdpbf16ps: prefill tiles of bfloat16 values (read in place, evenly
    // spaced: not paged), without dropout (whose factor would need a second rounding), where the
    // instruction is allowed and present (an AMX CPU has it too). kExact's on AMX tiles only, as
    // the three products of p's exact bfloat16 parts (BlockTile): on vdpbf16ps those would take
    // 1.5x the float32 product's instructions.
    const KernelPath pv_path = Bf16DotPath<T>({p.v.dtype});
    job.pv_pairs = std::is_same_v<T, float> && p.dtype == DType::kBFloat16 && !job.plan.decode && !p.batch_invariant &&
                   !p.v.paged() && !p.dropout.enabled() &&
                   (p.round_p ? pv_path != KernelPath::kSimd && cpu_has_avx512_bf16()
                              : pv_path == KernelPath::kAmxBf16);
    job.pv_amx = job.pv_pairs && pv_path == KernelPath::kAmxBf16;
    noted = std::max({noted, job.dot, job.pv_amx ? KernelPath::kAmxBf16 : job.pv_pairs ? KernelPath::kAvx512Bf16 : KernelPath::kSimd});
    amx |= job.dot == KernelPath::kAmxBf16 || job.pv_amx;
    job.partial_size = (p.Dv + 2 + kBadClasses * p.Dv) * job.mq;  // (ot, m, l, bad) of one block and chunk
    if (job.plan.needs_merge()) {
      const int64_t pieces = job.plan.blocks * job.plan.chunks, mq = static_cast<int64_t>(job.mq);
      job.partial.resize(static_cast<size_t>(pieces) * job.partial_size);
      if (p.stats.in_pass()) {
        job.partial_stat_reals.resize(static_cast<size_t>(pieces * LaneStats<T>::reals_size(mq, p.stats.topk)));
        job.partial_stat_ints.resize(static_cast<size_t>(pieces * LaneStats<T>::ints_size(mq, p.stats.topk)));
      }
    }
  }
  note_kernel_path(noted);
  // The largest units first (sequences of lengths that differ 100x): the threads then finish
  // together. The order changes no arithmetic.
  const auto per_unit = [](const Job<T>& job) { return job.plan.work / std::max<int64_t>(1, job.plan.units()); };
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job<T>& a, const Job<T>& b) { return per_unit(a) > per_unit(b); });
  for (Job<T>& job : jobs) {
    job.first_unit = units;
    job.first_merge = merges;
    units += job.plan.units();
    if (job.plan.needs_merge()) merges += job.plan.blocks;
    work += job.plan.work;
  }
  // The job of unit (or merged block) x: the last whose first is <= x (the firsts do not
  // decrease; a job without units shares its first with the next one).
  const auto job_of = [&](int64_t x, int64_t Job<T>::*first) {
    size_t lo = 0, hi = n;
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      (jobs[mid].*first <= x ? lo : hi) = mid;
    }
    return lo;
  };
  const int threads = threads_for(units, work);

  // One thread's part: `each(n, f)` calls f(i) for the i in [0, n) this thread takes (all of
  // them without a team; an orphaned `omp for`, ending in a barrier, within one).
  const auto thread_part = [&](const auto& each) {
    const AmxScope amx_scope(amx);  // the tile configuration loaded once per thread and call
    // This thread's scratch, one per kind of job it meets (a varlen batch has one kind).
    std::vector<std::pair<const Job<T>*, std::unique_ptr<Scratch<T>>>> scratches;
    const auto scratch = [&](const Job<T>& job) -> Scratch<T>& {
      for (auto& [owner, sc] : scratches)
        if (owner->same_scratch(job)) return *sc;
      scratches.emplace_back(&job, std::make_unique<Scratch<T>>(*job.p, job.mq, N, job.plan.group_blocks, job.dot,
                                                                 job.pv_pairs, job.pv_amx));
      return *scratches.back().second;
    };
    each(units, [&](int64_t u) {
      Job<T>& job = jobs[job_of(u, &Job<T>::first_unit)];
      RunUnit(d, job, u - job.first_unit, scratch(job));
    });
    each(merges, [&](int64_t x) {
      const Job<T>& job = jobs[job_of(x, &Job<T>::first_merge)];
      const int64_t bi = x - job.first_merge;
      Scratch<T>& s = scratch(job);
      const LaneStats<T> st = s.block(0).stats;
      const int64_t rs = st.reals != nullptr ? LaneStats<T>::reals_size(st.mq, st.k) : 0;
      const int64_t is = st.reals != nullptr ? LaneStats<T>::ints_size(st.mq, st.k) : 0;
      const int64_t at = bi * job.plan.chunks;
      MergeAndFinish(d, job, s, job.plan.block(bi), job.partial.data() + at * job.partial_size,
                     job.partial_stat_reals.data() + at * rs, job.partial_stat_ints.data() + at * is, job.plan.chunks);
    });
  };
  if (threads == 1) {  // no team: a decode step of a small model is shorter than starting one
    thread_part([](int64_t n, const auto& f) {
      for (int64_t i = 0; i < n; ++i) f(i);
    });
    return;
  }
#pragma omp parallel num_threads(threads)
  thread_part([](int64_t n, const auto& f) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
  });
}

template <typename T>
void Flash(const Problem& p) {
  const Problem* one = &p;
  FlashMany<T>(&one, 1);
}

}  // namespace sdpa::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SDPA_FLASH_INL_H_
