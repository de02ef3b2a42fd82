#!/usr/bin/env python3
"""A character-level GPT on sdpa.torch.MultiheadAttention: trains on a text file (default: the
project's own docs) on the CPU, prints the loss going down, samples text with an incremental
KV cache (sdpa.KVCache, one per layer), and can write an `sdpa inspect` report of its heads.

    .venv/bin/python examples/tiny_gpt/train.py                    # ~3 minutes on 2 cores
    .venv/bin/python examples/tiny_gpt/train.py --minutes 10 --inspect heads.html
    .venv/bin/python examples/tiny_gpt/train.py --compare          # tokens/s: sdpa's layer vs torch's

The model: token and position embeddings, `--layers` blocks of (LayerNorm, causal multi-head
attention, residual, LayerNorm, MLP 4x with GELU, residual), LayerNorm, a linear head tied to
the token embedding. `--attention torch` swaps in torch.nn.MultiheadAttention (same weights'
layout, same state_dict): `--compare` times a training step with each, in one run.
"""

import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import sdpa
import sdpa.torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Block(nn.Module):
    def __init__(self, d, heads, attention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        cls = sdpa.torch.MultiheadAttention if attention == "sdpa" else nn.MultiheadAttention
        self.attn = cls(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, causal_mask):
        h = self.ln1(x)
        # torch's module wants the mask with is_causal; sdpa's applies causal from is_causal alone.
        mask = causal_mask if isinstance(self.attn, nn.MultiheadAttention) else None
        a, _ = self.attn(h, h, h, need_weights=False, attn_mask=mask, is_causal=True)
        x = x + a
        return x + self.mlp(self.ln2(x))

    def step(self, x, cache, seqs):
        h = self.ln1(x)
        x = x + self.attn.step(h, cache, seqs)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, context, attention="sdpa"):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for emb in (self.tok, self.pos):  # GPT-2's: small, so that the tied head starts near uniform
            nn.init.normal_(emb.weight, std=0.02)
        self.register_buffer("causal_mask", torch.ones(context, context, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx):
        N = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(N))
        for b in self.blocks:
            x = b(x, self.causal_mask[:N, :N])
        return self.ln(x) @ self.tok.weight.T  # logits (B, N, vocab)

    @torch.no_grad()
    def sample(self, prompt, n, temperature=0.8, generator=None):
        """prompt (list of ids) continued by n ids, one token at a time with a KV cache per layer
        (sdpa.KVCache through MultiheadAttention.step): each step computes only the new token."""
        page = 16
        pages = (self.context + page - 1) // page + 1
        caches = [b.attn.new_cache(pages, page) for b in self.blocks]
        seqs = [c.new_sequence() for c in caches]
        out = list(prompt)
        x_ids = torch.tensor([prompt[-self.context:]])
        pos = 0
        for _ in range(n):
            N = x_ids.shape[1]
            x = self.tok(x_ids) + self.pos(torch.arange(pos, pos + N))
            for b, c, s in zip(self.blocks, caches, seqs):
                x = b.step(x, c, [s])
            logits = self.ln(x[:, -1]) @ self.tok.weight.T
            probs = F.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
            out.append(nxt)
            pos += N
            if pos >= self.context:  # the window is full: start again from the last tokens
                for c, s in zip(caches, seqs):
                    c.free(s)
                seqs = [c.new_sequence() for c in caches]
                x_ids = torch.tensor([out[-self.context // 2:]])
                pos = 0
            else:
                x_ids = torch.tensor([[nxt]])
        return out


def load_text(path):
    if path:
        return open(path, encoding="utf-8").read()
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


def batches(data, context, batch, rng):
    while True:
        starts = rng.integers(0, len(data) - context - 1, size=batch)
        x = np.stack([data[s:s + context] for s in starts])
        y = np.stack([data[s + 1:s + context + 1] for s in starts])
        yield torch.from_numpy(x).long(), torch.from_numpy(y).long()


def evaluate(model, data, context, rng, n=8):
    model.eval()
    with torch.no_grad():
        x, y = next(batches(data, context, n, rng))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    model.train()
    return loss


def tokens_per_second(args, vocab, data, attention, steps):
    torch.manual_seed(0)
    model = TinyGPT(vocab, args.d_model, args.heads, args.layers, args.context, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    it = batches(data, args.context, args.batch, np.random.default_rng(0))
    times = []
    for s in range(steps + 1):
        x, y = next(it)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return args.batch * args.context / float(np.median(times))


def write_report(model, text, stoi, path):
    """An `sdpa inspect` report of the first block's heads on a slice of the text."""
    blk = model.blocks[0]
    ids = torch.tensor([[stoi[c] for c in text[:min(len(text), model.context)]]])
    with torch.no_grad():
        h = blk.ln1(model.tok(ids) + model.pos(torch.arange(ids.shape[1])))
        (w_q, w_k, w_v), (b_q, b_k, b_v) = blk.attn._projections()
        heads = [blk.attn._heads(h, w, b, blk.attn.num_heads, None) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))]
    report = sdpa.inspect(*(t.numpy() for t in heads), causal=True, title="tiny GPT, block 0")
    report.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", help="a UTF-8 text file (default: README.md and docs/*.md)")
    ap.add_argument("--minutes", type=float, default=3.0, help="training time")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=0, help="threads for torch and sdpa (0: their defaults)")
    ap.add_argument("--attention", choices=("sdpa", "torch"), default="sdpa")
    ap.add_argument("--sample", type=int, default=300, help="characters to sample after training")
    ap.add_argument("--inspect", metavar="HTML", help="write an sdpa inspect report of block 0's heads")
    ap.add_argument("--compare", action="store_true", help="time training steps with sdpa's and torch's layer")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        sdpa.set_num_threads(args.threads)

    text = load_text(args.text)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int64)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    print(f"text: {len(text)} characters, {len(chars)} distinct; threads: torch {torch.get_num_threads()}, "
          f"sdpa {sdpa.num_threads()}")

    if args.compare:
        steps = args.steps or 20
        # Each layer timed twice, alternating (sdpa, torch, sdpa, torch); the second run of each is kept.
        rates = {a: tokens_per_second(args, len(chars), train, a, steps) for a in ("sdpa", "torch", "sdpa", "torch")}
        print(f"training step, median of {steps}: sdpa.torch.MultiheadAttention {rates['sdpa']:.0f} tokens/s, "
              f"torch.nn.MultiheadAttention {rates['torch']:.0f} tokens/s ({rates['sdpa'] / rates['torch']:.2f}x)")
        return

    torch.manual_seed(args.seed)
    model = TinyGPT(len(chars), args.d_model, args.heads, args.layers, args.context, args.attention)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.layers} layers, "
          f"d_model {args.d_model}, {args.heads} heads, context {args.context}, {args.attention} attention")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    it = batches(train, args.context, args.batch, rng)
    start, step, tokens = time.perf_counter(), 0, 0
    print(f"step 0: val loss {evaluate(model, val, args.context, rng):.3f} (uniform: {math.log(len(chars)):.3f})")
    while True:
        elapsed = time.perf_counter() - start
        if (args.steps and step >= args.steps) or (not args.steps and elapsed > 60 * args.minutes):
            break
        lr = args.lr * min(1.0, (step + 1) / 50)  # warm-up
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(it)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 50 == 0:
            t = time.perf_counter() - start
            print(f"step {step}: train loss {loss.item():.3f}, val loss {evaluate(model, val, args.context, rng):.3f}, "
                  f"{tokens / t:.0f} tokens/s, {t:.0f} s", flush=True)
    t = time.perf_counter() - start
    final = evaluate(model, val, args.context, rng, n=32)
    print(f"done: {step} steps in {t:.0f} s ({tokens / max(t, 1e-9):.0f} tokens/s), val loss {final:.3f}")

    if args.sample and args.attention == "sdpa":
        model.eval()
        prompt = [stoi[c] for c in "The kernel "] if all(c in stoi for c in "The kernel ") else [int(train[0])]
        g = torch.Generator().manual_seed(args.seed)
        out = model.sample(prompt, args.sample, generator=g)
        print("sample:\n" + "".join(chars[i] for i in out))
    if args.inspect:
        write_report(model, text[split:], stoi, args.inspect)
        print(f"wrote {args.inspect}")
    return final


if __name__ == "__main__":
    main()
