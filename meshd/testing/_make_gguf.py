"""Write tiny random-weight llama GGUF models (run by the llama.cpp venv's python, which has
gguf and numpy): `python _make_gguf.py OUT_DIR COUNT SEED [PREFIX [WIDTH LAYERS CONTEXT]]`
writes OUT_DIR/<PREFIX>-<i>.gguf (prefix "tiny").

Architecture llama, vocab 267 (<unk> <s> </s>, 256 byte tokens, 8 pieces), 64 wide, 2 layers,
4 heads, context 256, f32, with a chat template so chat completions work. A wider, deeper one
with a longer context generates slowly enough to be interrupted mid-answer. The same seed
gives the same bytes; models of different seeds answer differently.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

N_HEAD = 4
PIECES = ["\u2581", "\u2581the", "\u2581a", "e", "t", "o", "\u2581mesh", "s"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write(path: Path, seed: int, n_embd: int = 64, n_layer: int = 2, n_ctx: int = 256) -> None:
    N_EMBD, N_LAYER, N_FF, N_CTX = n_embd, n_layer, 2 * n_embd, n_ctx
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(PIECES)]
    scores = [0.0] * len(tokens)
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(path.stem)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)

    def t(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", t(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", t(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", t(n_vocab, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str]) -> None:
    out, count, seed = Path(argv[0]), int(argv[1]), int(argv[2])
    prefix = argv[3] if len(argv) > 3 else "tiny"
    shape = [int(a) for a in argv[4:7]]
    out.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = out / f"{prefix}-{i}.gguf"
        write(path, seed + i, *shape)
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
