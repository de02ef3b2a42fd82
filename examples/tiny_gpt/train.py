#!/usr/bin/env python3
"""A character-level GPT on sdpa.torch.MultiheadAttention: trains on a text file (default: the
project's own docs) on the CPU, prints the loss going down, samples text with an incremental
KV cache (sdpa.KVCache, one per layer), and can write an `sdpa inspect` report of its heads.

    .venv/bin/python examples/tiny_gpt/train.py                    # ~3 minutes on 2 cores
    .venv/bin/python examples/tiny_gpt/train.py --minutes 10 --inspect heads.html
    .venv/bin/python examples/tiny_gpt/train.py --compare          # tokens/s: sdpa's layer vs torch's
    .venv/bin/python examples/tiny_gpt/train.py --context-parallel 2 --steps 200  # the sequence split over 2 processes

The model: token and position embeddings, `--layers` blocks of (LayerNorm, causal multi-head
attention, residual, LayerNorm, MLP 4x with GELU, residual), LayerNorm, a linear head tied to
the token embedding. `--attention torch` swaps in torch.nn.MultiheadAttention (same weights'
layout, same state_dict): `--compare` times a training step with each, in one run.
`--context-parallel W` trains the same model with every sequence split over W processes
(torch.distributed, gloo on 127.0.0.1): each rank holds 1/W of each sequence's tokens in the
zigzag layout, its attention is sdpa.torch.distributed.ring_attention, everything else is per
token, and the parameter gradients are summed over the ranks; rank 0 prints the same losses as
the one-process run (up to rounding) and samples from the trained model.
"""

import argparse
import glob
import math
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import sdpa
import sdpa.torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_context_parallel(attn, training):
    """Refuses (ValueError) an attention module that Block.ring_attention would not compute
    faithfully: it reads in_proj_weight / in_proj_bias with num_heads heads for q, k and v, then
    causal ring attention with no dropout and no RoPE."""
    if not isinstance(attn, sdpa.torch.MultiheadAttention):
        raise ValueError(f"context parallelism needs sdpa.torch.MultiheadAttention, got {type(attn).__name__}")
    if attn.num_kv_heads != attn.num_heads:
        raise ValueError(f"context parallelism does not support GQA/MQA here: num_kv_heads {attn.num_kv_heads} != "
                         f"num_heads {attn.num_heads}")
    if attn.rope:
        raise ValueError("context parallelism does not support rope=True here (its positions are the zigzag "
                         "shard's, which the ring path does not rotate by)")
    if attn.in_proj_weight is None:
        raise ValueError(f"context parallelism needs one in_proj_weight (kdim {attn.kdim}, vdim {attn.vdim} must equal "
                         f"embed_dim {attn.embed_dim})")
    if training and attn.dropout > 0:
        raise ValueError(f"context parallelism does not support attention dropout in training here "
                         f"(dropout={attn.dropout})")


class Block(nn.Module):
    def __init__(self, d, heads, attention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        cls = sdpa.torch.MultiheadAttention if attention == "sdpa" else nn.MultiheadAttention
        self.attn = cls(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, causal_mask, group=None):
        h = self.ln1(x)
        if group is not None:
            a = self.ring_attention(h, group)
        else:
            # torch's module wants the mask with is_causal; sdpa's applies causal from is_causal alone.
            mask = causal_mask if isinstance(self.attn, nn.MultiheadAttention) else None
            a, _ = self.attn(h, h, h, need_weights=False, attn_mask=mask, is_causal=True)
        x = x + a
        return x + self.mlp(self.ln2(x))

    def ring_attention(self, h, group):
        """The module's attention on this rank's tokens (B, N / W, d) of sequences split over the
        group (zigzag layout): its projections, then ring attention over the ranks."""
        import sdpa.torch.distributed as sdist

        attn = self.attn
        check_context_parallel(attn, self.training)
        B, L, E = h.shape
        qkv = F.linear(h, attn.in_proj_weight, attn.in_proj_bias).view(B, L, 3, attn.num_heads, attn.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2).contiguous() for i in range(3))
        out = sdist.ring_attention(q, k, v, group=group, causal=True, layout="zigzag")
        return attn.out_proj(out.transpose(1, 2).reshape(B, L, E))

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

    def forward(self, idx, positions=None, group=None):
        """idx (B, N) -> logits (B, N, vocab). With a process group, idx holds this rank's tokens of
        each sequence and positions their positions (context parallelism, zigzag layout)."""
        N = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(N) if positions is None else positions)
        for b in self.blocks:
            x = b(x, self.causal_mask[:N, :N], group)
        return self.ln(x) @ self.tok.weight.T

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


class ContextParallel:
    """This rank's part of sequences split over a torch.distributed group in the zigzag layout
    (rank r holds chunks r and 2W - 1 - r of 2W; docs/DISTRIBUTED.md)."""

    def __init__(self, group, context):
        import sdpa.torch.distributed as sdist

        self.sdist, self.group = sdist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.positions = sdist.shard(torch.arange(context), 0, "zigzag", group)

    def loss(self, model, x, y):
        """(this rank's part, the whole loss): the mean cross-entropy over every rank's tokens is the
        sum of the ranks' parts, so the part's gradient is this rank's share of the gradient."""
        xs, ys = (self.sdist.shard(t, 1, "zigzag", self.group) for t in (x, y))
        logits = model(xs, self.positions, self.group)
        part = F.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="sum") / y.numel()
        whole = part.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return part, whole

    def sum_gradients(self, model):
        """Every rank's parameters get the sum of the ranks' gradients (one all-reduce)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def loss_of(model, x, y, cp=None):
    """(the loss to differentiate, the whole batch's loss) on one process or split over ranks."""
    if cp is not None:
        return cp.loss(model, x, y)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return loss, loss.detach()


def evaluate(model, data, context, rng, n=8, cp=None):
    model.eval()
    with torch.no_grad():
        x, y = next(batches(data, context, n, rng))
        loss = loss_of(model, x, y, cp)[1].item()
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
    ap.add_argument("--context-parallel", type=int, default=1, metavar="W",
                    help="split each sequence over W processes (ring attention over gloo on 127.0.0.1)")
    args = ap.parse_args()
    if args.context_parallel > 1:
        if args.attention != "sdpa" or args.compare:
            ap.error("--context-parallel trains sdpa's attention (no --attention torch, no --compare)")
        if args.context % (2 * args.context_parallel):
            ap.error(f"--context-parallel {args.context_parallel}: the zigzag layout cuts the context into "
                     f"{2 * args.context_parallel} chunks, so --context {args.context} must be a multiple of that")
        with socket.socket() as s:  # a free port for the ranks' rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(context_parallel_rank, args=(args, port), nprocs=args.context_parallel, join=True)
        return None
    return run(args)


def context_parallel_rank(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=args.context_parallel)
    args.threads = args.threads or 1  # W processes share the cores
    try:
        run(args, ContextParallel(dist.group.WORLD, args.context))
    finally:
        dist.destroy_process_group()


def run(args, cp=None):
    log = print if cp is None or cp.rank == 0 else (lambda *a, **k: None)
    if args.threads:
        torch.set_num_threads(args.threads)
        sdpa.set_num_threads(args.threads)

    text = load_text(args.text)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int64)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    log(f"text: {len(text)} characters, {len(chars)} distinct; threads: torch {torch.get_num_threads()}, "
        f"sdpa {sdpa.num_threads()}")

    if args.compare:
        steps = args.steps or 20
        # Each layer timed twice, alternating (sdpa, torch, sdpa, torch); the second run of each is kept.
        rates = {a: tokens_per_second(args, len(chars), train, a, steps) for a in ("sdpa", "torch", "sdpa", "torch")}
        log(f"training step, median of {steps}: sdpa.torch.MultiheadAttention {rates['sdpa']:.0f} tokens/s, "
            f"torch.nn.MultiheadAttention {rates['torch']:.0f} tokens/s ({rates['sdpa'] / rates['torch']:.2f}x)")
        return

    torch.manual_seed(args.seed)
    model = TinyGPT(len(chars), args.d_model, args.heads, args.layers, args.context, args.attention)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.layers} layers, "
        f"d_model {args.d_model}, {args.heads} heads, context {args.context}, {args.attention} attention"
        + (f", context parallel over {cp.world} ranks (zigzag)" if cp is not None else ""))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    it = batches(train, args.context, args.batch, rng)
    start, step, tokens = time.perf_counter(), 0, 0
    log(f"step 0: val loss {evaluate(model, val, args.context, rng, cp=cp):.3f} (uniform: {math.log(len(chars)):.3f})")
    while True:
        elapsed = time.perf_counter() - start
        stop = (args.steps and step >= args.steps) or (not args.steps and elapsed > 60 * args.minutes)
        if cp is not None:  # rank 0's clock decides for every rank
            flag = torch.tensor([int(bool(stop))])
            dist.broadcast(flag, 0, group=cp.group)
            stop = bool(flag.item())
        if stop:
            break
        lr = args.lr * min(1.0, (step + 1) / 50)  # warm-up
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(it)
        part, loss = loss_of(model, x, y, cp)
        opt.zero_grad()
        part.backward()
        if cp is not None:
            cp.sum_gradients(model)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 50 == 0:
            t = time.perf_counter() - start
            log(f"step {step}: train loss {loss.item():.3f}, val loss {evaluate(model, val, args.context, rng, cp=cp):.3f}, "
                f"{tokens / t:.0f} tokens/s, {t:.0f} s", flush=True)
    t = time.perf_counter() - start
    final = evaluate(model, val, args.context, rng, n=32, cp=cp)
    log(f"done: {step} steps in {t:.0f} s ({tokens / max(t, 1e-9):.0f} tokens/s), val loss {final:.3f}")

    if cp is not None and cp.rank != 0:
        return final
    if args.sample and args.attention == "sdpa":  # every rank holds the whole model: rank 0 samples
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
