"""Shared helpers for torch tests: tiny random HF checkpoints written by transformers itself."""

from __future__ import annotations

import os

import pytest
import torch

ARCHS = ("llama", "llama3", "llama_tied", "qwen2", "qwen3")
# DeepSeek MLA + MoE: with and without q LoRA, dense and MoE layers, both gate flavours, grouped
# and ungrouped routing, YaRN and plain RoPE, interleaved and half-split rope dims; V3.2's sparse
# attention (DSA) with index_topk below the prompts' lengths (the indexer drops keys) and above.
DSA_ARCHS = ("ds_v32_sparse", "ds_v32_dense")
DEEPSEEK_ARCHS = ("ds_v2", "ds_v2_grouped", "ds_v3", "ds_v3_flat", *DSA_ARCHS)
DSA_SPARSE_TOPK = 8
# Qwen3-MoE: every layer routed but one dense (mlp_only_layers), renormalised top-k; or every
# second layer routed (decoder_sparse_step), raw softmax weights, biased attention, tied head.
QWEN3_MOE_ARCHS = ("qwen3_moe", "qwen3_moe_step2")

_COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               initializer_range=0.1)  # larger than 0.02 so logits and RoPE effects are not tiny


_DEEPSEEK = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                 rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
         "mscale": 0.707, "mscale_all_dim": 0.707}


def deepseek_config(arch: str):
    import transformers as tf
    if arch == "ds_v2":  # V2-Lite-like: no q LoRA, greedy softmax gate, first layer dense, YaRN
        return tf.DeepseekV2Config(**_DEEPSEEK, q_lora_rank=None, n_shared_experts=2,
                                   first_k_dense_replace=1, topk_method="greedy",
                                   routed_scaling_factor=1.0, rope_scaling=dict(_YARN))
    if arch == "ds_v2_grouped":  # q LoRA, group-limited greedy, biases, plain RoPE
        return tf.DeepseekV2Config(**_DEEPSEEK, q_lora_rank=24, n_shared_experts=1,
                                   first_k_dense_replace=2, topk_method="group_limited_greedy",
                                   n_group=4, topk_group=1, routed_scaling_factor=2.0,
                                   attention_bias=True, rope_theta=10000.0)
    if arch == "ds_v3":  # q LoRA, sigmoid gate with bias, 4 groups of which 2, YaRN, interleaved
        return tf.DeepseekV3Config(**_DEEPSEEK, q_lora_rank=24, n_shared_experts=1,
                                   first_k_dense_replace=1, n_group=4, topk_group=2,
                                   norm_topk_prob=True, routed_scaling_factor=2.5,
                                   rope_interleave=True, rope_scaling=dict(_YARN))
    if arch == "ds_v3_flat":  # no q LoRA, one group, no renormalisation, every layer MoE
        return tf.DeepseekV3Config(**_DEEPSEEK, q_lora_rank=None, n_shared_experts=2,
                                   first_k_dense_replace=0, n_group=1, topk_group=1,
                                   norm_topk_prob=False, routed_scaling_factor=1.5,
                                   rope_interleave=False, rope_theta=10000.0)
    # keeps 8 keys per query; YaRN (the indexer shares its rope); two index heads, so a query
    # often scores several keys exactly 0 (both ReLUs off) and the tie rule decides
    if arch == "ds_v32_sparse":
        return tf.DeepseekV32Config(**_DEEPSEEK, q_lora_rank=24, n_shared_experts=1,
                                    first_k_dense_replace=1, n_group=4, topk_group=2,
                                    routed_scaling_factor=2.5, rope_parameters=dict(_YARN),
                                    index_topk=DSA_SPARSE_TOPK, index_n_heads=2,
                                    index_head_dim=16)
    if arch == "ds_v32_dense":  # index_topk beyond every test prompt: attends densely
        return tf.DeepseekV32Config(**_DEEPSEEK, q_lora_rank=24, n_shared_experts=2,
                                    first_k_dense_replace=0, n_group=1, topk_group=1,
                                    norm_topk_prob=False, routed_scaling_factor=1.5,
                                    index_topk=64, index_n_heads=4, index_head_dim=12)
    raise ValueError(f"unknown arch {arch!r}; choose from {DEEPSEEK_ARCHS}")


_QWEN3_MOE = dict(_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, rope_theta=1000000.0)


def hf_config(arch: str):
    import transformers as tf
    if arch in DEEPSEEK_ARCHS:
        return deepseek_config(arch)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_QWEN3_MOE, norm_topk_prob=True, mlp_only_layers=[1])
    if arch == "qwen3_moe_step2":
        return tf.Qwen3MoeConfig(**_QWEN3_MOE, decoder_sparse_step=2, attention_bias=True,
                                 tie_word_embeddings=True)
    if arch == "llama":
        return tf.LlamaConfig(**_COMMON, rope_theta=10000.0)
    if arch == "llama3":
        return tf.LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "llama_tied":
        return tf.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if arch == "qwen2":
        return tf.Qwen2Config(**_COMMON, rope_theta=1000000.0)
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16, rope_theta=1000000.0)
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def hf_model(arch: str, seed: int = 0):
    import transformers as tf
    cls = {"qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "ds_v2": tf.DeepseekV2ForCausalLM, "ds_v2_grouped": tf.DeepseekV2ForCausalLM,
           "ds_v3": tf.DeepseekV3ForCausalLM, "ds_v3_flat": tf.DeepseekV3ForCausalLM,
           **dict.fromkeys(DSA_ARCHS, tf.DeepseekV32ForCausalLM),
           **dict.fromkeys(QWEN3_MOE_ARCHS, tf.Qwen3MoeForCausalLM),
           }.get(arch, tf.LlamaForCausalLM)
    torch.manual_seed(seed)
    model = cls(hf_config(arch)).float().eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the qwen2 test meaningful
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():  # V3's router bias changes which experts win
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def write_tiny_checkpoint(tmp_path, arch: str = "llama", seed: int = 0,
                          max_shard_size: str | int | None = None) -> str:
    """Save a tiny fp32 random HF model of `arch` under tmp_path/arch; returns the directory."""
    path = os.path.join(str(tmp_path), arch if max_shard_size is None else arch + "-sharded")
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf_model(arch, seed).save_pretrained(path, **kwargs)
    return path


def write_tiny_checkpoints(root, archs) -> dict[str, str]:
    """arch -> a tiny checkpoint of each arch under root."""
    return {arch: write_tiny_checkpoint(root, arch) for arch in archs}


def hf_prompt_logits(archs, prompt: list[int]) -> dict[str, torch.Tensor]:
    """arch -> transformers' float logits [len(prompt), V] (the checkpoints' seed)."""
    with torch.no_grad():
        return {a: hf_model(a)(torch.tensor([prompt])).logits[0].float() for a in archs}


def cpu_context(args, layers: range, is_first: bool, is_last: bool, dtype=torch.float32):
    """The StageContext of a stage holding `layers`, on the CPU with the torch kernels."""
    from stages.kernels.registry import select_kernels
    from stages.stage_context import StageContext

    return StageContext(
        args, layers, is_first, is_last, select_kernels("cpu"), dtype, torch.device("cpu")
    )


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> checkpoint directory, written once per session."""
    return write_tiny_checkpoints(tmp_path_factory.mktemp("ckpt"), ARCHS)


class Reads(list):
    """Names of the tensors read, in order; `values[name]`: the values read of each (a
    tensor-parallel rank reads slices)."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, int] = {}

    def add(self, name: str, t) -> None:
        self.append(name)
        self.values[name] = self.values.get(name, 0) + t.numel()


@pytest.fixture
def tensor_reads(monkeypatch) -> Reads:
    """Names of the checkpoint tensors the loader reads (safetensors' get_tensor, or a slice
    of one through get_slice), in order."""
    import stages.loader as loader

    read = Reads()
    real_open = loader.safe_open

    class Slice:
        def __init__(self, name, s):
            self.name, self.s = name, s

        def get_dtype(self):
            return self.s.get_dtype()

        def __getitem__(self, index):
            t = self.s[index]
            read.add(self.name, t)
            return t

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            read.add(name, t)
            return t

        def get_slice(self, name):
            return Slice(name, self.f.get_slice(name))

        def keys(self):
            return self.f.keys()

    monkeypatch.setattr(loader, "safe_open", Recording)
    return read


def pytest_collection_modifyitems(config, items):
    """Tests on the triton_interpreter fixture carry the `interpreter` marker: `make test` runs
    them apart, with TRITON_INTERPRET=1."""
    for item in items:
        if "triton_interpreter" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.interpreter)


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run by Triton's CPU interpreter: needs triton and TRITON_INTERPRET=1 set
    before triton is imported (`TRITON_INTERPRET=1 pytest ...`), else the test is skipped. Also
    makes the interpreter's scalar __index__ work with NumPy 2.4+, which refuses int() of a
    one-element array."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton interpreter tests run with TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)
    convert = interpreter._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        """float32 -> bfloat16 or e4m3 rounded to nearest even, as compiled kernels cast by
        default (the interpreter truncates, and its own rounding mode does not carry into the
        exponent)."""
        import numpy as np
        import triton.language as tl

        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(input, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert_float)
