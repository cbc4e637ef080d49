"""Tiny random models of the supported families, built from transformers' config classes.

Nothing is downloaded. ``make_model(family, seed)`` returns an fp32 model in eval mode; sizes
are chosen so a forward takes milliseconds on a CPU core, with every layer type present.
"""

from __future__ import annotations

import torch
import transformers as tf

FAMILIES = ("qwen3_5", "qwen3_next", "nemotron_h", "kimi_linear")
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
    raise ValueError(family)


def make_model(family: str, seed: int = 0, small: bool = False, vocab: int = VOCAB):
    """A tiny fp32 model of ``family`` (``small``: fewer layers, for a draft model)."""
    torch.manual_seed(seed)
    cfg = _config(family, small, vocab)
    cls = {
        "qwen3_5": tf.Qwen3_5ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
        "nemotron_h": tf.NemotronHForCausalLM, "kimi_linear": tf.KimiLinearForCausalLM,
    }[family]
    model = cls(cfg).eval()
    # random init leaves some gates tiny; scale weights up a little so logits are well separated
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model


def perturbed_copy(model, scale: float = 0.05, seed: int = 1):
    """A copy of ``model`` with Gaussian noise (relative ``scale``) on every weight: a draft that
    agrees with the target often but not always."""
    import copy

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
