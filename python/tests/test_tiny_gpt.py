"""examples/tiny_gpt: a small model trains (the loss goes down), samples through its per-layer
KV caches with the same logits as the full forward, and writes an inspect report. Skipped
without torch, except under CI (as test_torch.py)."""

import importlib.util
import math
import os

import numpy as np

from torch_required import import_torch  # noqa: E402

torch = import_torch(module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("tiny_gpt", os.path.join(ROOT, "examples", "tiny_gpt", "train.py"))
tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny)


def test_trains_and_the_cache_gives_the_full_forwards_logits(tmp_path):
    text = tiny.load_text(None)
    chars = sorted(set(text))
    data = np.array([{c: i for i, c in enumerate(chars)}[c] for c in text[:20000]], dtype=np.int64)
    torch.manual_seed(0)
    model = tiny.TinyGPT(len(chars), 32, 2, 2, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    before = tiny.evaluate(model, data, 32, np.random.default_rng(1), n=16)
    assert abs(before - math.log(len(chars))) < 0.5  # starts near uniform
    it = tiny.batches(data, 32, 16, rng)
    for _ in range(60):
        x, y = next(it)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = tiny.evaluate(model, data, 32, np.random.default_rng(1), n=16)
    assert after < before - 0.5, (before, after)

    # Logits token by token through the caches against the full forward's, within 4x the full
    # forward's own float32 error (against the same model in float64).
    model.eval()
    ids = torch.from_numpy(data[:20]).view(1, -1)
    with torch.no_grad():
        full = model(ids)[0]
        full64 = tiny.TinyGPT(len(chars), 32, 2, 2, 32)
        full64.load_state_dict(model.state_dict())
        full64 = full64.double()(ids)[0]
        caches = [b.attn.new_cache(4, 16) for b in model.blocks]
        seqs = [c.new_sequence() for c in caches]
        stepped = []
        for i in range(ids.shape[1]):
            x = model.tok(ids[:, i:i + 1]) + model.pos(torch.tensor([i]))
            for b, c, s in zip(model.blocks, caches, seqs):
                x = b.step(x, c, [s])
            stepped.append((model.ln(x) @ model.tok.weight.T)[0, 0])
    stepped = torch.stack(stepped)
    tol = 4 * (full.double() - full64).abs().max().item() + 1.2e-7 * full64.abs().max().item()
    assert (stepped - full).abs().max().item() <= tol
    out = model.sample([0, 1, 2], 40, generator=torch.Generator().manual_seed(0))
    assert len(out) == 43 and all(0 <= t < len(chars) for t in out)

    path = tmp_path / "heads.html"
    tiny.write_report(model, text[:200], {c: i for i, c in enumerate(chars)}, str(path))
    assert path.stat().st_size > 1000 and "<html" in path.read_text()[:200].lower()


def test_context_parallel_refuses_what_its_ring_path_does_not_compute():
    """Block.ring_attention computes causal attention of in_proj_weight's heads, no dropout, no
    RoPE: other modules are refused by name, not silently computed otherwise."""
    import sdpa.torch
    mha = sdpa.torch.MultiheadAttention
    tiny.check_context_parallel(mha(16, 4, batch_first=True), True)
    tiny.check_context_parallel(mha(16, 4, dropout=0.1, batch_first=True), False)  # (eval: no dropout)
    for attn, training, words in ((mha(16, 4, dropout=0.1), True, "dropout=0.1"),
                                  (mha(16, 4, rope=True), True, "rope=True"),
                                  (mha(16, 4, num_kv_heads=2), True, "num_kv_heads 2 != num_heads 4"),
                                  (mha(16, 4, kdim=8), True, "kdim 8"),
                                  (torch.nn.MultiheadAttention(16, 4), True, "got MultiheadAttention")):
        try:
            tiny.check_context_parallel(attn, training)
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"no error for {words}")
