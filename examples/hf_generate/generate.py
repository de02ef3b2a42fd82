"""Greedy generation with a Hugging Face Llama-config model (random weights, nothing downloaded),
once with transformers' "sdpa" (PyTorch's function) and once with sdpa's ("sdpa_cpu", from
sdpa.transformers.register()), printing tokens/s for both and whether the tokens agree.

    python examples/hf_generate/generate.py [--layers 4] [--hidden 512] [--prompt 256] [--new 64] [--batch 4]

Needs torch, transformers (5.x) and sdpa built with its torch operators (README.md, PyTorch).
"""

import argparse
import copy
import time

import torch
import transformers

import sdpa.transformers


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    name = sdpa.transformers.register()  # "sdpa_cpu"
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                      num_key_value_heads=a.kv_heads, max_position_embeddings=a.prompt + a.new)
    torch.manual_seed(0)
    ids = torch.randint(1, config.vocab_size, (a.batch, a.prompt))
    mask = torch.ones_like(ids)
    mask[1:, : a.prompt // 4] = 0  # left padding, as batched generate() pads
    state = None
    results = {}
    for impl in ("sdpa", name, "sdpa", name):  # each twice: the first run warms up
        # (a config each: from_config keeps the one it is given and reads the implementation from it)
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        with torch.no_grad():
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new,
                                 do_sample=False, pad_token_id=0)
            seconds = time.perf_counter() - t
        results[impl] = (out[:, a.prompt:], a.batch * a.new / seconds)
    for impl, (_, rate) in results.items():
        print(f"{impl:>9}: {rate:8.1f} tokens/s  (batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, "
              f"{a.layers} layers, hidden {a.hidden}, heads {a.heads}/{a.kv_heads}, {torch.get_num_threads()} threads)")
    same = torch.equal(results["sdpa"][0], results[name][0])
    print("tokens: " + ("the same" if same else "differ (random weights make near-ties; see the README)"))


if __name__ == "__main__":
    main()
