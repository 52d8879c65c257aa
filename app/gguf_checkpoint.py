"""A Llama-architecture GGUF file -> a Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files with the chat template).

The `gguf` package (the format's own library) reads the file, names the tensors and dequantizes
them; transformers writes the config and converts the GGUF tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

GGUF_ARCHITECTURES = ("llama",)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def hf_config_dict(reader: Any) -> dict[str, Any]:
    """LlamaConfig keyword arguments from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's RoPE halves)."""
    half = w.shape[0] // n_heads // 2
    out: np.ndarray = w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def hf_state_dict(reader: Any, config: Any, dtype: torch.dtype,
                  progress: Callable[[Iterable[str]], Iterable[str]] | None = None,
                  ) -> dict[str, torch.Tensor]:
    """Every tensor of the HF model, dequantized by `gguf` and named by its tensor-name map."""
    import gguf
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        names = list(LlamaForCausalLM(config).state_dict())
    if config.tie_word_embeddings:
        names.remove("lm_head.weight")
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name in progress(names) if progress else names:
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            raise KeyError(f"GGUF file lacks {gguf_name!r} (for {name})")
        t = tensors[gguf_name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)  # a writable copy
    return out


def convert_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `out_dir` as a Hugging Face checkpoint of the GGUF file at `gguf_path`."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    reader = GGUFReader(gguf_path)
    cfg = hf_config_dict(reader)
    config = LlamaConfig(**cfg, architectures=["LlamaForCausalLM"], dtype=dtype)
    state = hf_state_dict(reader, config, dtype,
                          lambda xs: tqdm(xs, desc="Dequantizing GGUF tensors", unit="tensor"))
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                     pad_token_id=cfg["pad_token_id"]).save_pretrained(out_dir)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
