"""Write a tiny random-weight Llama (transformers format) and PEFT LoRA adapters for it, for
vLLM (run by the vLLM venv's python): `python _make_hf_llama.py OUT_DIR ADAPTERS SEED
[HIDDEN LAYERS HEADS CONTEXT]` writes OUT_DIR/base and OUT_DIR/lora-<i>.

By default hidden 128, 2 layers, 2 heads (head_dim 64), 512 positions; bf16, a byte-level BPE
vocabulary of 256 bytes and 3 specials (a token a byte), a chat template; adapters of rank 8
on q_proj and v_proj, each seeded apart so each changes the answers differently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HIDDEN, LAYERS, HEADS, CONTEXT, RANK = 128, 2, 2, 512, 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(argv: list[str]) -> None:
    out, adapters, seed = Path(argv[0]), int(argv[1]), int(argv[2])
    shape = (HIDDEN, LAYERS, HEADS, CONTEXT) if len(argv) < 7 else tuple(int(x) for x in argv[3:7])
    hidden, layers, heads, context = shape
    torch.manual_seed(seed)
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    base = out / "base"
    model.save_pretrained(base, safe_serialization=True)
    tok.save_pretrained(base)
    print(base)
    for i in range(adapters):
        g = torch.Generator().manual_seed(seed * 1000 + i + 1)
        tensors = {}
        for layer in range(layers):
            for proj in ("q_proj", "v_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g).to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, RANK, generator=g).to(torch.bfloat16)
        path = out / f"lora-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": RANK,
            "lora_alpha": 4 * RANK,
            "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"],
            "bias": "none",
            "fan_in_fan_out": False,
            "base_model_name_or_path": str(base),
        }
        (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
