"""Tiny random models of the supported families, built from transformers' config classes.

Nothing is downloaded. ``make_model(family, seed)`` returns an fp32 model in eval mode; sizes
are chosen so a forward takes milliseconds on a CPU core, with every layer type present.
``get_model`` shares one target / draft / small model per family across a test process;
``ragged_prompts`` makes left-padded prompts; ``tiny_tokenizer`` decodes the tiny vocabulary.
"""

from __future__ import annotations

import copy

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

FAMILIES = ("qwen3_5", "qwen3_next", "nemotron_h", "kimi_linear")
#: further hybrid families (tests/test_families.py)
EXTRA_FAMILIES = ("qwen3_5_moe", "bamba", "falcon_h1", "granitemoehybrid", "zamba2", "mamba2", "olmo_hybrid", "lfm2")
#: attention-only causal LMs (rollback = KV length)
ATTENTION_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "olmo2", "granite")
VOCAB = 96


def _config(family: str, small: bool = False, vocab: int = VOCAB):
    h = 32 if small else 48
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2 if small else 4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=(["linear_attention", "full_attention"] if small else ["linear_attention"] * 3 + ["full_attention"]),
            max_position_embeddings=512, tie_word_embeddings=False,
        )
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h,
            shared_expert_intermediate_size=h, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            num_hidden_layers=2 if small else 4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"] if small else ["linear_attention"] * 3 + ["full_attention"],
            max_position_embeddings=512, mlp_only_layers=[],
        )
    if family == "nemotron_h":
        return tf.NemotronHConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2 if small else 5,
            hybrid_override_pattern="M*" if small else "M-M*-", num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
            chunk_size=16, max_position_embeddings=512,
        )
    if family == "kimi_linear":
        return tf.KimiLinearConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2 if small else 4,
            num_attention_heads=2, num_key_value_heads=2, linear_num_heads=2, linear_head_dim=8,
            linear_conv_kernel_dim=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, moe_intermediate_size=h, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            layer_types=["linear_attention", "full_attention"] if small
            else ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse"] if small else ["dense", "sparse", "sparse", "dense"],
            max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2 if vocab > 2 else None,
        )
    return _extra_config(family, small, vocab)


def _extra_config(family: str, small: bool, vocab: int):
    h = 32 if small else 48
    n = 2 if small else 4
    common = dict(vocab_size=vocab, hidden_size=h, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(
            **common, num_hidden_layers=n, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, moe_intermediate_size=h, shared_expert_intermediate_size=h, num_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"] if small else ["linear_attention"] * 3 + ["full_attention"],
            tie_word_embeddings=False,
        )
    mamba = dict(mamba_n_heads=4, mamba_d_head=2 * h // 4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16)
    if family == "bamba":
        return tf.BambaConfig(
            **common, **mamba, intermediate_size=2 * h, num_hidden_layers=n, num_attention_heads=2,
            num_key_value_heads=1, attn_layer_indices=[1] if small else [2], tie_word_embeddings=False,
        )
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **common, **mamba, intermediate_size=2 * h, num_hidden_layers=n, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=h,
            layer_types=["linear_attention", "full_attention"] if small
            else ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            position_embedding_type="rope", embedding_multiplier=1.5, residual_multiplier=0.7,
            attention_multiplier=0.2, logits_scaling=1.5, tie_word_embeddings=False,
        )
    if family == "falcon_h1":
        return tf.FalconH1Config(
            **common, intermediate_size=2 * h, num_hidden_layers=2 if small else 3, num_attention_heads=2,
            num_key_value_heads=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16,
            ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.05], ssm_in_multiplier=1.1, ssm_out_multiplier=0.9,
            attention_in_multiplier=1.1, attention_out_multiplier=0.9, key_multiplier=0.9,
            embedding_multiplier=1.2, lm_head_multiplier=0.8, mlp_multipliers=[1.1, 0.9], tie_word_embeddings=False,
        )
    if family == "zamba2":
        return tf.Zamba2Config(
            **common, intermediate_size=2 * h, num_hidden_layers=n,
            layers_block_type=["mamba", "hybrid"] if small else ["mamba", "hybrid", "mamba", "hybrid"],
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=16,
            num_attention_heads=2, num_key_value_heads=2, num_mem_blocks=1, use_shared_attention_adapter=True,
            adapter_rank=4, use_mem_rope=True, tie_word_embeddings=False,
        )
    if family == "mamba2":
        return tf.Mamba2Config(
            vocab_size=vocab, hidden_size=h, num_hidden_layers=2 if small else 3, num_heads=4, head_dim=2 * h // 4,
            expand=2, state_size=8, n_groups=2, conv_kernel=4, chunk_size=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False,
        )
    if family == "olmo_hybrid":
        return tf.OlmoHybridConfig(
            **common, intermediate_size=2 * h, num_hidden_layers=n, num_attention_heads=2, num_key_value_heads=1,
            layer_types=["linear_attention", "full_attention"] if small
            else ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, tie_word_embeddings=False,
        )
    if family == "lfm2":
        return tf.Lfm2Config(
            **common, intermediate_size=2 * h, num_hidden_layers=n, num_attention_heads=2, num_key_value_heads=1,
            conv_L_cache=3, block_auto_adjust_ff_dim=False,
            layer_types=["conv", "full_attention"] if small else ["conv", "conv", "full_attention", "conv"],
            tie_word_embeddings=False,
        )
    attn = dict(**common, intermediate_size=2 * h, num_hidden_layers=2 if small else 3, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(**attn)
    if family == "qwen2":
        return tf.Qwen2Config(**attn)
    if family == "qwen3":
        return tf.Qwen3Config(**attn, head_dim=16)
    if family == "mistral":
        return tf.MistralConfig(**attn, sliding_window=8)  # shorter than prompt + new tokens
    if family == "mixtral":
        return tf.MixtralConfig(**attn, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**attn, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=h,
                                 shared_expert_intermediate_size=h)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**attn, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=h, head_dim=16)
    if family == "phi3":
        return tf.Phi3Config(**attn)
    if family == "olmo2":
        return tf.Olmo2Config(**attn)
    if family == "granite":
        return tf.GraniteConfig(**attn, logits_scaling=2.0, embedding_multiplier=1.5, residual_multiplier=0.5,
                                attention_multiplier=0.2)
    raise ValueError(family)


_CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM", "nemotron_h": "NemotronHForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "bamba": "BambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "zamba2": "Zamba2ForCausalLM", "mamba2": "Mamba2ForCausalLM", "olmo_hybrid": "OlmoHybridForCausalLM",
    "lfm2": "Lfm2ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
}


def make_model(family: str, seed: int = 0, small: bool = False, vocab: int = VOCAB):
    """A tiny fp32 model of ``family`` (``small``: fewer layers, for a draft model)."""
    torch.manual_seed(seed)
    cfg = _config(family, small, vocab)
    model = getattr(tf, _CLASSES[family])(cfg).eval()
    # random init leaves some gates tiny; scale weights up a little so logits are well separated
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model


def perturbed_copy(model, scale: float = 0.05, seed: int = 1):
    """A copy of ``model`` with Gaussian noise (relative ``scale``) on every weight: a draft that
    agrees with the target often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * (p.float().std() if p.numel() > 1 else 1.0))
    return draft


def ragged_prompts(batch: int = 3, vocab: int = VOCAB, lengths=(12, 7, 10), seed: int = 0, repeat: bool = True):
    """Left-padded prompts of different lengths (ids >= 3, so 0 is free for padding).

    With ``repeat`` each prompt repeats its own first half, so n-gram lookup finds matches.
    Returns ``(input_ids [B, L], attention_mask [B, L])``.
    """
    g = torch.Generator().manual_seed(seed)
    L = max(lengths[:batch])
    ids = torch.zeros(batch, L, dtype=torch.long)
    mask = torch.zeros(batch, L, dtype=torch.long)
    for i in range(batch):
        n = lengths[i % len(lengths)]
        row = torch.randint(3, vocab, (n,), generator=g)
        if repeat and n >= 4:
            half = n // 2
            row[n - half :] = row[:half]
        ids[i, L - n :] = row
        mask[i, L - n :] = 1
    return ids, mask


_MODELS: dict = {}


def get_model(family: str, kind: str = "target"):
    """The tiny models of ``family``, built once per test process and shared (do not modify them):
    ``kind`` ``"target"`` (:func:`make_model`, seed 0), ``"perturbed"`` (:func:`perturbed_copy` of
    the target: a draft model that often agrees) or ``"small"`` (fewer layers, seed 1)."""
    key = (family, kind)
    if key not in _MODELS:
        if kind == "target":
            _MODELS[key] = make_model(family, seed=0)
        elif kind == "perturbed":
            _MODELS[key] = perturbed_copy(get_model(family, "target"))
        elif kind == "small":
            _MODELS[key] = make_model(family, seed=1, small=True)
        else:
            raise ValueError(f"unknown model kind {kind!r}; use 'target', 'perturbed' or 'small'")
    return _MODELS[key]


def tiny_tokenizer():
    """A word-level fast tokenizer for the tiny vocabulary: id i is the word ``w{i}`` (``w0``
    padding and unknown, ``w2`` EOS); decoding joins words with spaces."""
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tf.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", eos_token="w2")
