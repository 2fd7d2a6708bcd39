"""A tiny random float32 Llama checkpoint, built locally with a fixed seed (no download).

Needs ``torch`` and ``transformers`` (the vLLM environment has both). Re-running with the
same arguments writes byte-identical weights; ``WEIGHTS_SHA256`` records their digest.

    python -m kvxfer.testing.tiny_model --layers 2 --kv-heads 2 --out /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Any


def build(
    out: str,
    *,
    layers: int = 2,
    kv_heads: int = 2,
    heads: int = 4,
    head_dim: int = 32,
    intermediate: int = 256,
    vocab: int = 1024,
    max_pos: int = 4096,
    seed: int = 1234,
    sliding_window: int | None = None,
) -> str:
    """Write the checkpoint to ``out`` (skipped when it is already there) and return the
    hex sha256 of its weights. ``sliding_window``: a Mistral whose every layer attends to
    that many tokens (vLLM then keeps a sliding-window KV cache)."""
    digest_path = os.path.join(out, "WEIGHTS_SHA256")
    shape = [layers, kv_heads, heads, head_dim, intermediate, vocab, max_pos, seed]
    want = json.dumps(shape if sliding_window is None else [*shape, sliding_window])
    args_path = os.path.join(out, "BUILD_ARGS")
    if os.path.exists(digest_path) and os.path.exists(args_path):
        with open(args_path) as f:
            if f.read() == want:
                with open(digest_path) as g:
                    return g.read().strip()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    if heads % kv_heads:
        raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads}")
    config_cls: Any = LlamaConfig if sliding_window is None else MistralConfig
    extra = {} if sliding_window is None else {"sliding_window": sliding_window}
    cfg = config_cls(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model_cls: Any = LlamaForCausalLM if sliding_window is None else MistralForCausalLM
    model: Any = model_cls(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # explicit init: independent of transformers' init order
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                # wide logits: greedy decoding is not decided by near-ties
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    d["torch_dtype"] = d["dtype"] = "float32"
    with open(cfg_path, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
    h = hashlib.sha256()
    for n, t in sorted(model.state_dict().items()):
        h.update(n.encode())
        h.update(t.contiguous().numpy().tobytes())
    digest = h.hexdigest()
    with open(digest_path, "w") as f:
        f.write(digest + "\n")
    with open(args_path, "w") as f:
        f.write(want)
    return digest


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    print(build(a.out, layers=a.layers, kv_heads=a.kv_heads, heads=a.heads,
                head_dim=a.head_dim, vocab=a.vocab, seed=a.seed))  # fmt: skip


if __name__ == "__main__":
    main()
