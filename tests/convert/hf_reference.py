"""Reference side of the Hugging Face tests (every family): runs in the Python 3.11 torch env (.venv311,
made by scripts/setup_torch_env.sh), never in the moejax env.

  make OUT_DIR                  small random models of each family, saved with save_pretrained,
                                and their fp32 reference logits on random tokens (MODELS and
                                MULTIMODAL_MODELS below, the latter on text alone):
                                OUT_DIR/NAME/ (the checkpoint), OUT_DIR/NAME.tokens.npy,
                                OUT_DIR/NAME.logits.npy; then FP8 copies of some (FP8_MODELS),
                                the logits transformers computes from them (dequantizing on CPU)
                                and OUT_DIR/NAME_dequantized/, its dequantized weights saved
  logits HF_DIR TOKENS OUT      loads HF_DIR with transformers, writes fp32 logits for TOKENS
  (serve only) random_model     a random model from a config.json dict, saved to a directory
  (serve only) token_losses     per-token cross-entropy of a model on inputs/targets
  (serve only) gated_delta_net  Qwen3-Next's linear attention layer's output on hidden states
  serve                         the two commands above as JSON lines on stdin -> one JSON reply
                                line each on stdout ({"cmd": "make", "args": {...}}), so a test
                                session imports torch once

Run by hand: .venv311/bin/python tests/convert/hf_reference.py make /tmp/olmoe_ref
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import fp8_configs      # tests/convert/, beside this script

# Random configurations, each differing from the others and from the family presets in layers,
# heads, kv heads, head width, experts, top-k, expert width, shared expert width, RoPE base and
# scaling (b, qwen3_moe and deepseek_v3 YaRN), norm epsilon, top-k renormalization and how the
# checkpoint is saved.
MODELS = {
    "a": dict(
        model_type="olmoe",
        config=dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=False, rope_theta=10000.0, rms_norm_eps=1e-5),
        # the Hub's layout: one tensor per expert projection, sharded with an index
        save=dict(max_shard_size="64KB")),
    "b": dict(
        model_type="olmoe",
        config=dict(vocab_size=80, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=3, num_experts=6, num_experts_per_tok=3,
                    norm_topk_prob=True, rms_norm_eps=1e-6, router_aux_loss_coef=0.02,
                    # YaRN, its attention factor from the factor alone (0.1 ln 4 + 1)
                    rope_parameters=dict(rope_type="yarn", rope_theta=500000.0, factor=4.0,
                                         original_max_position_embeddings=64),
                    max_position_embeddings=256),
        # transformers >= 5 in-memory layout: fused gate_up_proj / down_proj, one file
        save=dict(save_original_format=False)),
    "mixtral": dict(
        model_type="mixtral",
        config=dict(vocab_size=72, hidden_size=40, intermediate_size=28, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    num_local_experts=5, num_experts_per_tok=2, rope_theta=1000000.0,
                    # every layer within 6 of the 16 tokens (Mistral's sliding window)
                    rms_norm_eps=1e-5, sliding_window=6),
        save=dict(max_shard_size="64KB")),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        config=dict(vocab_size=88, hidden_size=36, intermediate_size=52, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, num_experts=6,
                    num_experts_per_tok=3, moe_intermediate_size=20,
                    shared_expert_intermediate_size=44, norm_topk_prob=False, qkv_bias=True,
                    rope_theta=20000.0, rms_norm_eps=1e-6, mlp_only_layers=[1]),   # MoE dense MoE
        save=dict(save_original_format=False)),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_experts=10,
                    num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True,
                    rms_norm_eps=1e-6,
                    decoder_sparse_step=2,                   # layer 0 dense, layer 1 MoE
                    # YaRN as Qwen's long-context configs, untruncated, attention factor given
                    rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=6.0,
                                         original_max_position_embeddings=40, truncate=False,
                                         attention_factor=1.25, beta_fast=24.0, beta_slow=2.0),
                    max_position_embeddings=240),
        save=dict()),
    # DeepSeek-V3: latent attention with a q latent, two leading dense layers, two shared
    # experts, 12 experts in 3 groups (2 used), a random score bias, routed scaling; fused.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        config=dict(vocab_size=68, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
                    first_k_dense_replace=2, num_attention_heads=5, num_key_value_heads=5,
                    q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6,
                    v_head_dim=10, n_routed_experts=12, n_group=3, topk_group=2,
                    num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
                    routed_scaling_factor=1.7, norm_topk_prob=True, rms_norm_eps=1e-6,
                    # YaRN as DeepSeek-V3's, mscale != mscale_all_dim (cos and sin scaled too)
                    rope_parameters=dict(rope_type="yarn", rope_theta=30000.0, factor=8.0,
                                         original_max_position_embeddings=32, beta_fast=32,
                                         beta_slow=1, mscale=0.9, mscale_all_dim=0.7),
                    max_position_embeddings=256),
        save=dict(save_original_format=False)),
    # DeepSeek-V3.2: DeepSeek-V3 with sparse attention, each of the 16 queries attending to the
    # 5 best of its earlier keys by the indexer (16 heads of 10, 4 dims rotated half-split: with
    # few heads a key's relu'd scores are all 0 often, and torch.topk breaks such ties its own
    # way); dense layers by mlp_layer_types, YaRN scaling the indexer's rotation too; the Hub's
    # layout.
    "deepseek_v32": dict(
        model_type="deepseek_v32",
        config=dict(vocab_size=60, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                    mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                    n_group=2, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=12,
                    n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                    index_topk=5, index_n_heads=16, index_head_dim=10,
                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                         original_max_position_embeddings=32, beta_fast=32,
                                         beta_slow=1, mscale=1.0, mscale_all_dim=0.8),
                    max_position_embeddings=128),
        save=dict(max_shard_size="64KB")),
    # GLM-5: DeepSeek-V3.2's sparse attention with the indexer's 6 rotated dims in neighbour
    # pairs, each of the 16 queries keeping its 6 best keys; no expert groups, the first layer
    # dense by first_k_dense_replace, transformers' default RoPE; fused.
    "glm_moe_dsa": dict(
        model_type="glm_moe_dsa",
        config=dict(vocab_size=52, hidden_size=36, intermediate_size=44, num_hidden_layers=3,
                    first_k_dense_replace=1, num_attention_heads=3, num_key_value_heads=3,
                    q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=10, qk_rope_head_dim=6,
                    v_head_dim=14, n_routed_experts=6, num_experts_per_tok=2,
                    moe_intermediate_size=12, n_shared_experts=1, routed_scaling_factor=2.0,
                    index_topk=6, index_n_heads=16, index_head_dim=8, rms_norm_eps=1e-5),
        save=dict(save_original_format=False)),
    # MiniMax-M2: QK-norm over all heads' width (wider than hidden), 16 of each head's 24 dims
    # rotated (its legacy rotary_dim field), sigmoid top-3 of 8 with a random score bias,
    # renormalized; the Hub's layout (block_sparse_moe, w1/w3/w2, the bias beside the gate).
    "minimax_m2": dict(
        model_type="minimax_m2",
        config=dict(vocab_size=48, hidden_size=32, intermediate_size=20, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24, rotary_dim=16,
                    num_local_experts=8, num_experts_per_tok=3, rope_theta=5000000.0,
                    rms_norm_eps=1e-6),
        save=dict(max_shard_size="64KB")),
    # ERNIE-4.5: neighbour-pair rotary, a dense layer between MoE layers (moe_layer_interval 2
    # from layer 1), two shared experts, softmax top-3 of 8 with a random selection bias ([1, E]
    # under moe_statics), renormalized, tied embeddings; per expert.
    "ernie4_5_moe": dict(
        model_type="ernie4_5_moe",
        config=dict(vocab_size=44, hidden_size=32, intermediate_size=36, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, moe_num_experts=8, moe_k=3,
                    moe_intermediate_size=20, moe_num_shared_experts=2, moe_layer_start_index=1,
                    moe_layer_end_index=-1, moe_layer_interval=2, rope_theta=500000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
        save=dict()),
    # GLM-4.5: grouped-query attention with q/k/v biases and per-head QK-norm, half of each
    # head rotated, a leading dense layer, one shared expert, sigmoid top-3 among the best 2 of 3
    # groups with a random score bias, renormalized and scaled; per expert, with the
    # multi-token-prediction layer the Hub's checkpoints carry.
    "glm4_moe": dict(
        model_type="glm4_moe",
        config=dict(vocab_size=56, hidden_size=40, intermediate_size=48, num_hidden_layers=3,
                    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=12, partial_rotary_factor=0.5, attention_bias=True,
                    use_qk_norm=True, n_routed_experts=9, n_group=3, topk_group=2,
                    num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=1,
                    routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=100000.0,
                    rms_norm_eps=1e-5),
        save=dict(max_shard_size="64KB")),
    # dots.llm1: per-head QK-norm, a leading dense layer, two shared experts, sigmoid top-2
    # among the best 2 of 4 groups with a random score bias, not renormalized, scaled; sliding
    # window set but past the last layer (max_window_layers); fused.
    "dots1": dict(
        model_type="dots1",
        config=dict(vocab_size=52, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                    first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                    head_dim=20, n_routed_experts=8, n_group=4, topk_group=2,
                    num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=2,
                    routed_scaling_factor=1.5, norm_topk_prob=False, rope_theta=50000.0,
                    rms_norm_eps=1e-6, sliding_window=8, max_window_layers=3),
        save=dict(save_original_format=False)),
    # DeepSeek-V2: latent attention without a q latent, a leading dense layer, softmax top-3
    # among the 2 of 3 groups with the best expert, routed scaling, no renormalization, YaRN as
    # V2-Lite's (both mscales equal: only the softmax scale moves); per expert.
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        config=dict(vocab_size=60, hidden_size=36, intermediate_size=44, num_hidden_layers=3,
                    first_k_dense_replace=1, num_attention_heads=3, num_key_value_heads=3,
                    q_lora_rank=None, kv_lora_rank=18, qk_nope_head_dim=10, qk_rope_head_dim=8,
                    v_head_dim=12, n_routed_experts=9, n_group=3, topk_group=2,
                    topk_method="group_limited_greedy", num_experts_per_tok=3,
                    moe_intermediate_size=16, n_shared_experts=2, routed_scaling_factor=2.0,
                    rms_norm_eps=1e-6, aux_loss_alpha=0.004,
                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=16.0,
                                         original_max_position_embeddings=16, mscale=0.707,
                                         mscale_all_dim=0.707),
                    max_position_embeddings=256),
        save=dict()),
    # ... without a q latent, dense layers or groups, unnormalized top-k, tied embeddings; per
    # expert and sharded.
    "deepseek_v3_b": dict(
        model_type="deepseek_v3",
        config=dict(vocab_size=76, hidden_size=28, intermediate_size=36, num_hidden_layers=2,
                    first_k_dense_replace=0, num_attention_heads=2, num_key_value_heads=2,
                    q_lora_rank=None, kv_lora_rank=14, qk_nope_head_dim=10, qk_rope_head_dim=4,
                    v_head_dim=14, n_routed_experts=6, n_group=1, topk_group=1,
                    num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
                    routed_scaling_factor=1.0, norm_topk_prob=False, rope_theta=10000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
        save=dict(max_shard_size="64KB")),
    # GLM-4.7-Flash: latent attention with a q latent, GLM's router, transformers' defaults for
    # what is left out (the first layer dense by mlp_layer_types' default, one shared expert, no
    # groups, routed scaling 1.8); per expert, sharded.
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite",
        config=dict(vocab_size=58, hidden_size=32, intermediate_size=44, num_hidden_layers=3,
                    num_attention_heads=3, num_key_value_heads=3, q_lora_rank=20,
                    kv_lora_rank=16, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12,
                    n_routed_experts=7, num_experts_per_tok=3, moe_intermediate_size=12,
                    norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-5),
        save=dict(max_shard_size="64KB")),
    # Solar Open: grouped-query attention with q/k/v biases and whole heads rotated, experts in
    # every layer, one shared expert, GLM's sigmoid router with a random score bias, scaled;
    # per expert, sharded.
    "solar_open": dict(
        model_type="solar_open",
        config=dict(vocab_size=62, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12, attention_bias=True,
                    n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                    n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                    rms_norm_eps=1e-5),
        save=dict(max_shard_size="64KB")),
    # MiniCPM5-MoE: grouped-query attention with a sigmoid output gate (the Hub's q_proj, twice
    # as wide: each head's query rows then its gate rows), two leading dense layers from
    # first_k_dense_replace (no mlp_layer_types), one shared expert, GLM's sigmoid router with a
    # random score bias, routed scaling; the Hub's layout (per expert), one file.
    "minicpm5_moe": dict(
        model_type="minicpm5_moe",
        config=dict(vocab_size=54, hidden_size=32, intermediate_size=36, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                    first_k_dense_replace=2, n_routed_experts=6, num_experts_per_tok=3,
                    moe_intermediate_size=12, n_shared_experts=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, rope_theta=100000.0, rms_norm_eps=1e-5),
        save=dict()),
    # Hy3: per-head QK-norm, two leading dense layers from mlp_layer_types, one shared expert,
    # a sigmoid router with a random score bias, always renormalized, scaled by
    # router_scaling_factor; the Hub's names (mlp.router.gate, mlp.expert_bias, mlp.shared_mlp,
    # one tensor per expert), sharded.
    "hy_v3": dict(
        model_type="hy_v3",
        config=dict(vocab_size=66, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    mlp_layer_types=["dense", "dense", "sparse", "sparse"], num_experts=7,
                    num_experts_per_tok=3, moe_intermediate_size=8, num_shared_experts=2,
                    router_scaling_factor=1.7, rope_theta=50000.0, rms_norm_eps=1e-6),
        save=dict(max_shard_size="64KB")),
    # EXAONE-MoE: per-head QK-norm; sliding layers from sliding_window_pattern 3 (layers 0, 1,
    # 3, 4 slide within 3 tokens, 2 and 5 attend to all without rotary embeddings), the dense
    # first layer from first_k_dense_replace, one shared expert, the DeepSeek-V3 router with a
    # random score bias in 2 groups of 3, routed scaling; per expert.
    "exaone_moe": dict(
        model_type="exaone_moe",
        config=dict(vocab_size=60, hidden_size=32, intermediate_size=36, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    sliding_window=3, sliding_window_pattern=3, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=12, num_shared_experts=1,
                    n_group=2, topk_group=1, routed_scaling_factor=1.3, rms_norm_eps=1e-6,
                    rope_theta=20000.0),
        save=dict()),
    # Granite MoE: grouped-query attention, softmax over the top-k logits, the four multipliers
    # (embedding, residual, softmax scale, logits), tied embeddings; the Hub's fused layout
    # (block_sparse_moe.input_linear [E, 2F, D], output_linear, router.layer), one file.
    "granitemoe": dict(
        model_type="granitemoe",
        config=dict(vocab_size=58, hidden_size=32, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=5,
                    num_experts_per_tok=2, embedding_multiplier=6.0, residual_multiplier=0.3,
                    attention_multiplier=0.2, logits_scaling=3.0, tie_word_embeddings=True,
                    rms_norm_eps=1e-6, rope_theta=10000.0),
        save=dict()),
    # ... with a shared MLP (shared_mlp.input_linear: gate rows then up rows), untied; saved in
    # transformers' own fused names (save_original_format=False), sharded.
    "granitemoeshared": dict(
        model_type="granitemoeshared",
        config=dict(vocab_size=62, hidden_size=32, intermediate_size=8, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, num_local_experts=6,
                    num_experts_per_tok=3, shared_intermediate_size=20,
                    embedding_multiplier=2.0, residual_multiplier=0.7,
                    attention_multiplier=0.1, logits_scaling=1.5, tie_word_embeddings=False,
                    rms_norm_eps=1e-5),
        save=dict(save_original_format=False, max_shard_size="64KB")),
    # Sarvam-MoE: GLM-4.5's architecture under its own Hub names (attention.query_key_value
    # with q/k/v biases, attention.dense, query_ / key_layernorm, word_embeddings,
    # mlp.gate.expert_bias) and its original config's field names (num_experts,
    # num_shared_experts, use_qkv_bias); per expert.
    "sarvam_moe": dict(
        model_type="sarvam_moe",
        config=dict(vocab_size=56, hidden_size=32, intermediate_size=28, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                    num_shared_experts=2, use_qkv_bias=True, num_experts_per_tok=2,
                    moe_intermediate_size=12, routed_scaling_factor=1.5, rms_norm_eps=1e-5),
        save=dict()),
    # Param2: the same names, tied embeddings, no biases; transformers' fused layout, sharded.
    "param2moe": dict(
        model_type="param2moe",
        config=dict(vocab_size=52, hidden_size=32, intermediate_size=20, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                    n_routed_experts=5, num_experts_per_tok=2, moe_intermediate_size=8,
                    n_shared_experts=1, first_k_dense_replace=2, rms_norm_eps=1e-6),
        save=dict(save_original_format=False, max_shard_size="64KB")),
    # FlexOlmo: OLMo 2's post-sublayer norms and QK-norm over all heads' width (grouped-query
    # here), OLMoE's softmax top-k, renormalized; per expert.
    "flex_olmo": dict(
        model_type="flex_olmo",
        config=dict(vocab_size=64, hidden_size=32, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_experts=5,
                    num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
                    rope_theta=30000.0),
        save=dict()),
    # Hunyuan-A13B: per-head QK-norm after RoPE (query_ / key_layernorm), a per-layer list of
    # one value (moe_topk), a shared MLP of intermediate_size beside the experts,
    # the router's gate.wg, NTK-alpha RoPE ("dynamic" with alpha); per expert.
    "hunyuan_v1_moe": dict(
        model_type="hunyuan_v1_moe",
        config=dict(vocab_size=70, hidden_size=32, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_experts=6, moe_topk=[2, 2], rms_norm_eps=1e-5,
                    rope_parameters=dict(type="dynamic", alpha=50.0, factor=1.0,
                                         rope_theta=10000.0)),
        save=dict()),
    # AfMoE: sandwich norms, per-head QK-norm, the output gate's own gate_proj, layers 0, 1, 3, 4
    # sliding within 3 tokens (global_attn_every_n_layers 3; 2 and 5 global, unrotated), the
    # embedding scaled by sqrt(hidden) (mup_enabled), a dense first layer, two shared experts,
    # sigmoid top-k with a random expert_bias, renormalized and scaled; per expert.
    "afmoe": dict(
        model_type="afmoe",
        config=dict(vocab_size=68, hidden_size=32, intermediate_size=40, num_hidden_layers=6,
                    num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                    num_shared_experts=2, route_scale=1.6, global_attn_every_n_layers=3,
                    sliding_window=3, mup_enabled=True, rms_norm_eps=1e-5,
                    rope_theta=40000.0),
        save=dict()),
    # Granite SWA: attention sinks, layers 1-3 sliding within 3 tokens (absent layer_types:
    # every 4th from layer 0 global), a RoPE base per layer (layer 0 unrotated, the sliding
    # layers' own base, layer 4's the model's), Granite's multipliers, a shared MLP; saved in
    # its own (transformers') fused names.
    "granitemoe_swa": dict(
        model_type="granitemoe_swa",
        config=dict(vocab_size=66, hidden_size=32, intermediate_size=12, num_hidden_layers=5,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=5,
                    num_experts_per_tok=2, shared_intermediate_size=16, sliding_window=3,
                    layer_rope_theta=[0, 8000.0, 8000.0, 8000.0, 60000.0],
                    embedding_multiplier=3.0, residual_multiplier=0.6,
                    attention_multiplier=0.3, logits_scaling=2.0, rms_norm_eps=1e-6),
        save=dict()),
    # Flint: sinks (under the Hub's name softmax_offset), per-head QK-norm, layers 2, 3 and 5
    # sliding within 3 tokens (absent layer_types: all but 0, 1, every 4th from 1 and the last),
    # the others unrotated, the first two dense (mlp_only_layers absent), sigmoid top-k
    # renormalized, an ungated shared expert; per expert.
    "flint": dict(
        model_type="flint",
        config=dict(vocab_size=70, hidden_size=32, intermediate_size=28, num_hidden_layers=7,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=12,
                    shared_expert_intermediate_size=20, sliding_window=3,
                    rope_parameters=dict(rope_type="default", rope_theta=20000.0),
                    rms_norm_eps=1e-6),
        save=dict()),
    # Kolibri: sandwich norms (the Hub's post_attn_norm / post_ffn_norm), per-head QK-norm,
    # layers 0-3 and 5 sliding within 3 tokens (absent layer_types: all but every 5th), layer 4
    # global and unrotated, sigmoid scores chosen by the logits plus a random bias (the Hub's
    # moe.router.expert_bias), renormalized, an ungated shared expert; per expert.
    "kolibri1": dict(
        model_type="kolibri1",
        config=dict(vocab_size=76, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_experts=7, num_experts_per_tok=2,
                    moe_intermediate_size=12, shared_expert_intermediate_size=16,
                    norm_topk_prob=True, sliding_window=3,
                    rope_parameters=dict(rope_type="default", rope_theta=30000.0),
                    rms_norm_eps=1e-6),
        save=dict()),
    # Mellum: per-head QK-norm, layers 0, 2, 3 sliding within 3 tokens by their own plain RoPE
    # (rope_parameters per layer type), layer 1 attending to all under YaRN, layer 1's MLP dense
    # between MoE ones (mlp_layer_types), softmax top-k not renormalized; per expert.
    "mellum": dict(
        model_type="mellum",
        config=dict(vocab_size=74, hidden_size=32, intermediate_size=36, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=False,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "sliding_attention"],
                    mlp_layer_types=["sparse", "dense", "sparse", "sparse"], sliding_window=3,
                    rope_parameters={
                        "full_attention": dict(rope_type="yarn", rope_theta=300000.0, factor=4.0,
                                               original_max_position_embeddings=8),
                        "sliding_attention": dict(rope_type="default", rope_theta=5000.0)},
                    max_position_embeddings=32, rms_norm_eps=1e-6),
        save=dict()),
    # gpt-oss: biases on q, k, v and o, sinks, layers 0 and 2 sliding within 3 tokens (absent
    # layer_types: every other from layer 0), its config class's YaRN (absent rope_parameters:
    # x32 from 4096, untruncated), a router with a bias, softmax over the top-2 logits, experts
    # with biases and the clamped SwiGLU at a limit the values cross (0.3) and another slope;
    # its one layout (gate and up interleaved, [in, out]). MXFP4 copy: test_hf_parity.py.
    "gpt_oss": dict(
        model_type="gpt_oss",
        config=dict(vocab_size=78, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=6, num_experts_per_tok=2, sliding_window=3,
                    swiglu_limit=0.3, swiglu_alpha=1.5, rms_norm_eps=1e-5),
        save=dict()),
    # Cohere2-MoE: parallel blocks, LayerNorm (no rms_norm_eps), neighbour-pair rotary, layer 0
    # dense and rotated (first_k_dense_replace 1, prefix pattern 1), MoE layers 1, 2 and 4
    # sliding within 3 tokens, layer 3 global and unrotated (sliding_window_pattern 3), softmax
    # over the top-2 logits, a shared expert averaged with the routed ones, logit_scale 0.25,
    # tied embeddings; "b": RMSNorm, biases on q, k, v and o, two dense layers unrotated (prefix
    # pattern 2: layer 1 global), sigmoid top-2 not renormalized, the shared experts summed.
    "cohere2_moe": dict(
        model_type="cohere2_moe",
        config=dict(vocab_size=82, hidden_size=32, intermediate_size=12, num_hidden_layers=5,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                    num_experts_per_tok=2, num_shared_experts=1,
                    shared_expert_combination_strategy="average", expert_selection_fn="softmax",
                    first_k_dense_replace=1, prefix_dense_intermediate_size=24,
                    prefix_dense_sliding_window_pattern=1, sliding_window_pattern=3,
                    sliding_window=3, logit_scale=0.25, layer_norm_eps=1e-5,
                    rope_parameters=dict(rope_type="default", rope_theta=20000.0)),
        save=dict()),
    "cohere2_moe_b": dict(
        model_type="cohere2_moe",
        config=dict(vocab_size=70, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=5,
                    num_experts_per_tok=2, num_shared_experts=2,
                    shared_expert_combination_strategy="sum", expert_selection_fn="sigmoid",
                    norm_topk_prob=False, first_k_dense_replace=2,
                    prefix_dense_intermediate_size=20, prefix_dense_sliding_window_pattern=2,
                    sliding_window_pattern=2, sliding_window=3, logit_scale=0.5,
                    rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="default", rope_theta=30000.0)),
        save=dict(save_original_format=False)),
    # Qwen3-Next: layers 0, 2 and 3 Gated DeltaNet (2 key heads of 8 over 4 value heads of 6,
    # 4 taps), layer 1 softmax attention (its output gate, per-head QK-norm, a quarter of each
    # head rotated), zero-centered norms; layer 2 dense (mlp_only_layers), the others top-2 of
    # 6 experts beside a gated shared expert
    # Granite-4.0-H: layers 0, 1 and 3 Mamba-2 (2 groups of state 8 over 8 heads of 8, 4 taps,
    # chunks of 16: the 20 tokens span two), layer 2 softmax attention without position
    # embedding; top-2 of 6 experts beside a shared MLP; the multipliers; the Hub's fused layout.
    "granitemoehybrid": dict(
        model_type="granitemoehybrid",
        config=dict(vocab_size=60, hidden_size=32, intermediate_size=12, num_hidden_layers=4,
                    layer_types=["mamba", "mamba", "attention", "mamba"],
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                    num_experts_per_tok=2, shared_intermediate_size=20, mamba_n_heads=8,
                    mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                    mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=3.0,
                    residual_multiplier=0.6, attention_multiplier=0.15, logits_scaling=2.0,
                    tie_word_embeddings=False, rms_norm_eps=1e-5,
                    position_embedding_type=None),
        save=dict()),
    "qwen3_next": dict(
        model_type="qwen3_next",
        config=dict(vocab_size=60, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention",
                                 "linear_attention"],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=12,
                    shared_expert_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[2],
                    rms_norm_eps=1e-6,
                    rope_parameters=dict(rope_type="default", rope_theta=20000.0,
                                         partial_rotary_factor=0.25)),
        save=dict()),
    # Llama 4: layers 0 and 2 dense (interleave_moe_layer_step 2), layers 0-2 rotated (Llama 3's
    # scaling, neighbour pairs) with the unscaled per-head QK-norm and chunks of 5 of the 16
    # tokens, layer 3 unrotated over all of them with its queries' temperature (floor 4, scale
    # 0.5), sigmoid top-2 scaling the experts' inputs, a shared expert; its one layout (gate
    # and up halves of gate_up_proj, [in, out]).
    "llama4": dict(
        model_type="llama4_text",
        config=dict(vocab_size=66, hidden_size=32, intermediate_size=12,
                    intermediate_size_mlp=20, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_local_experts=5,
                    num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=5,
                    floor_scale=4, attn_scale=0.5, rms_norm_eps=1e-5,
                    rope_parameters=dict(rope_type="llama3", rope_theta=50000.0, factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8)),
        save=dict()),
}
# Multimodal models (AutoModelForImageTextToText), their logits on text alone. Qwen3-VL-MoE:
# a Qwen3-MoE text model (always renormalizing its top-3 of 6, layer 1 dense), interleaved
# multimodal RoPE, a one-block vision encoder; saved as transformers 5 saves it (experts
# [out, in]; the Hub's [in, out] copy is the test's).
MULTIMODAL_MODELS = {
    "qwen3_vl_moe": dict(
        model_type="qwen3_vl_moe",
        config=dict(
            tie_word_embeddings=False,
            text_config=dict(vocab_size=70, hidden_size=32, intermediate_size=40,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_experts=6, num_experts_per_tok=3,
                             moe_intermediate_size=12, rms_norm_eps=1e-6, mlp_only_layers=[1],
                             rope_parameters=dict(rope_type="default", rope_theta=300000.0,
                                                  mrope_section=[2, 3, 3],
                                                  mrope_interleaved=True)),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                               out_hidden_size=32, patch_size=4, num_position_embeddings=16,
                               deepstack_visual_indexes=[0])),
        save=dict()),
    # GLM-4.5V / GLM-4.6V: a GLM-4.5 text model (grouped sigmoid top-2 of 6 with its score
    # bias, a shared expert, layer 0 dense, half of each head rotated, biased q/k/v), its
    # multimodal RoPE in sections, a one-block vision encoder
    "glm4v_moe": dict(
        model_type="glm4v_moe",
        config=dict(
            text_config=dict(vocab_size=74, hidden_size=32, intermediate_size=44,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=12, n_routed_experts=6, num_experts_per_tok=2,
                             n_shared_experts=1, moe_intermediate_size=12, n_group=2,
                             topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                             rms_norm_eps=1e-5,
                             rope_parameters=dict(rope_type="default", rope_theta=20000.0,
                                                  partial_rotary_factor=0.5,
                                                  mrope_section=[1, 1, 1])),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                               out_hidden_size=32, patch_size=4, image_size=16)),
        save=dict()),
    # Qwen3.5-MoE: its own text model (Qwen3-Next's layers, projections held apart, experts in
    # every layer, always renormalized): layers 0, 2, 3 Gated DeltaNet, layer 1 softmax
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        config=dict(
            text_config=dict(vocab_size=66, hidden_size=32, num_hidden_layers=4,
                             layer_types=["linear_attention", "full_attention",
                                          "linear_attention", "linear_attention"],
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=6,
                             linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=3,
                             moe_intermediate_size=12, shared_expert_intermediate_size=16,
                             rms_norm_eps=1e-6,
                             rope_parameters=dict(rope_type="default", rope_theta=40000.0,
                                                  partial_rotary_factor=0.25,
                                                  mrope_section=[1, 1, 0],
                                                  mrope_interleaved=True)),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                               out_hidden_size=32, patch_size=4, num_position_embeddings=16)),
        save=dict()),
}
# FP8 copies: every projection float8 e4m3 beside its scales; embeddings, head, router and norms
# as they were. As the Hub's DeepSeek-V3, Qwen3-*-FP8 and MiniMax-M2 are stored (transformers'
# fine-grained FP8: one weight_scale_inv per block; non-square blocks for Qwen3, so rows and
# columns cannot be swapped unnoticed), and as llm-compressor stores its FP8 checkpoints
# (compressed-tensors' float-quantized format, weight_scale per row).
# And INT4 as Kimi-K2-Thinking's experts are stored (compressed-tensors' pack-quantized format:
# symmetric 4-bit integers packed 8 to an int32 word, a bf16 weight_scale per group of a row).
# name -> (base model, compressed-tensors strategy or None, block (0 a whole dimension),
#          integer bits or 0 for FP8)
FP8_MODELS = {"qwen3_moe_fp8": ("qwen3_moe", None, (8, 4), 0),
              "minimax_m2_fp8": ("minimax_m2", None, (4, 4), 0),
              "deepseek_v3_b_fp8": ("deepseek_v3_b", None, (2, 2), 0),
              "mixtral_ct_fp8": ("mixtral", "channel", (1, 0), 0),
              "glm4_moe_ct_fp8": ("glm4_moe", "channel", (1, 0), 0),
              "qwen3_moe_int4": ("qwen3_moe", "group", (1, 8), 4)}
# (compressed-tensors' other strategies are checked against a reference of moejax's tests:
# transformers 5.25 leaves per-tensor scales undecompressed and fails on fused experts' blocks)
FP8_MAX = 448.0                 # largest finite float8 e4m3fn
FP8_UNQUANTIZED = ("embed_tokens.", "lm_head.", ".gate.weight")
TOKENS_SHAPE = (2, 16)
WEIGHT_STD = 0.1       # larger than OLMoE's 0.02 so routing and attention are far from uniform


def _torch():
  import torch
  torch.set_num_threads(1)
  return torch


def _load(hf_dir):
  torch = _torch()
  from transformers import AutoModelForCausalLM
  extra = {}
  with open(os.path.join(hf_dir, "config.json")) as f:
    quantization = json.load(f).get("quantization_config") or {}
  if quantization.get("quant_method") == "mxfp4":
    # on CPU transformers would fetch Triton kernels from the Hub (offline here): its own
    # dequantizing load instead (convert_moe_packed_tensors)
    from transformers import Mxfp4Config
    extra["quantization_config"] = Mxfp4Config(dequantize=True)
  model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                     attn_implementation="eager",
                                                     output_loading_info=True, **extra)
  return model.eval(), {k: sorted(map(str, v)) for k, v in info.items() if v}


def _logits(model, tokens):
  import numpy as np
  torch = _torch()
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits
  return out.to(torch.float32).numpy()


def _randomize(model, torch) -> None:
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight") or "layernorm" in pname:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))   # norms start at 1; make them differ
      else:
        p.normal_(0.0, WEIGHT_STD)
    for bname, b in model.named_buffers():
      if bname.endswith("e_score_correction_bias"):   # DeepSeek's selection-only bias
        b.normal_(0.0, WEIGHT_STD)


def random_model(config: dict, out_dir: str, seed: int = 0) -> dict:
  """A random model of `config` (a config.json dict, any family), weights scaled as in `make`."""
  torch = _torch()
  from transformers import AutoConfig, AutoModelForCausalLM
  torch.manual_seed(seed)
  config = dict(config)
  hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
  net = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
  net = net.to(torch.float32).eval()
  _randomize(net, torch)
  net.save_pretrained(out_dir)
  return {"hf_dir": out_dir}


def token_losses(hf_dir: str, inputs: str, targets: str, out: str) -> dict:
  """Per-token cross-entropy [B, S] (fp32) of the model at hf_dir on the inputs/targets files."""
  import numpy as np
  torch = _torch()
  net, info = _load(hf_dir)
  inputs_BxS, targets_BxS = np.load(inputs), np.load(targets)
  with torch.no_grad():
    logits = net(input_ids=torch.from_numpy(inputs_BxS.astype(np.int64))).logits.float()
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        torch.from_numpy(targets_BxS.astype(np.int64)).reshape(-1), reduction="none")
  np.save(out, losses.reshape(targets_BxS.shape).numpy())
  return {"loading_info": info}


def make(out_dir: str) -> dict:
  import numpy as np
  torch = _torch()
  from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
  os.makedirs(out_dir, exist_ok=True)
  made = {}
  specs = [(name, spec, AutoModelForCausalLM) for name, spec in sorted(MODELS.items())] + [
      (name, spec, AutoModelForImageTextToText) for name, spec in MULTIMODAL_MODELS.items()]
  for seed, (name, spec, auto) in enumerate(specs):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(spec["model_type"], **spec["config"],
                                  initializer_range=WEIGHT_STD, pad_token_id=None,
                                  eos_token_id=None, bos_token_id=None)
    model = auto.from_config(config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    _randomize(model, torch)
    hf_dir = os.path.join(out_dir, name)
    model.save_pretrained(hf_dir, **spec["save"])
    tokens = np.random.default_rng(seed).integers(0, config.get_text_config().vocab_size,
                                                  TOKENS_SHAPE)
    tokens = tokens.astype(np.int32)
    np.save(os.path.join(out_dir, f"{name}.tokens.npy"), tokens)
    np.save(os.path.join(out_dir, f"{name}.logits.npy"), _logits(model, tokens))
    made[name] = hf_dir
  made.update(make_fp8(out_dir))
  return {"models": made}


def quantize_fp8(src_dir: str, out_dir: str, strategy: str | None, block: tuple[int, int],
                 int_bits: int = 0) -> None:
  """A copy of the checkpoint at src_dir with every 2-D projection stored float8 e4m3 beside its
  per-block scales (amax / 448, the grid rounded up; 0 in `block`: a whole dimension),
  config.json declaring it: transformers' fine-grained FP8 (`strategy` None) or
  compressed-tensors' float-quantized format with that weight strategy; with `int_bits`, its
  pack-quantized format (symmetric integers packed by compressed-tensors' own pack_to_int32,
  bf16 scales)."""
  torch = _torch()
  from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

  def edit(tensors: dict) -> dict:
    out = {}
    for name, w in tensors.items():
      if w.ndim != 2 or not name.endswith(".weight") or any(k in name for k in FP8_UNQUANTIZED):
        out[name] = w
        continue
      rows, cols = w.shape
      bm, bn = block[0] or rows, block[1] or cols
      grid_r, grid_c = -(-rows // bm), -(-cols // bn)
      padded = torch.zeros(grid_r * bm, grid_c * bn)
      padded[:rows, :cols] = w.float()
      blocks = padded.reshape(grid_r, bm, grid_c, bn)
      top = 2 ** (int_bits - 1) - 1 if int_bits else FP8_MAX
      scale = (blocks.abs().amax(dim=(1, 3)) / top).clamp(min=1e-12)
      if int_bits:
        scale = scale.to(torch.bfloat16)
        q = (blocks / scale.float()[:, None, :, None]).reshape(grid_r * bm, grid_c * bn)
        q = q[:rows, :cols].round().clamp(-top - 1, top).to(torch.int8)
        out[name + "_packed"] = pack_to_int32(q, int_bits)
        out[name + "_shape"] = torch.tensor([rows, cols])     # int64, as compressed-tensors
        out[name + "_scale"] = scale.contiguous()
        continue
      q = (blocks / scale[:, None, :, None]).reshape(grid_r * bm, grid_c * bn)[:rows, :cols]
      out[name] = q.to(torch.float8_e4m3fn).contiguous()
      if strategy is None:
        out[name + "_scale_inv"] = scale.contiguous()
      else:             # llm-compressor's shapes: [1] per tensor, [rows, 1] per channel
        scale = scale.reshape(1) if strategy == "tensor" else scale
        out[name + "_scale"] = scale.contiguous()
    return out

  # weights only: with dynamic input activations transformers' forward also rounds the
  # activations to FP8 (inference), which import leaves to the run's compute dtype
  _rewrite_checkpoint(src_dir, out_dir, edit, lambda config: config.update(
      quantization_config=fp8_configs.quantization_config(strategy, block, int_bits)))


def _rewrite_checkpoint(src_dir: str, out_dir: str, edit_tensors, edit_config) -> None:
  """out_dir: a copy of the checkpoint at src_dir, each shard's tensors through
  `edit_tensors(dict) -> dict`, the index's weight_map following, config.json through
  `edit_config(dict)` (in place)."""
  import glob
  import shutil
  from safetensors import safe_open
  from safetensors.torch import load_file, save_file
  shutil.rmtree(out_dir, ignore_errors=True)
  shutil.copytree(src_dir, out_dir)
  weight_map = {}
  for path in sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))):
    save_file(edit_tensors(load_file(path)), path, metadata={"format": "pt"})
    with safe_open(path, "pt") as f:
      weight_map.update({k: os.path.basename(path) for k in f.keys()})
  index_path = os.path.join(out_dir, "model.safetensors.index.json")
  if os.path.exists(index_path):
    with open(index_path) as f:
      index = json.load(f)
    index["weight_map"] = dict(sorted(weight_map.items()))
    with open(index_path, "w") as f:
      json.dump(index, f, indent=2)
  config_path = os.path.join(out_dir, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  edit_config(config)
  with open(config_path, "w") as f:
    json.dump(config, f, indent=2)


def make_fp8(out_dir: str) -> dict:
  """FP8_MODELS from the models `make` wrote: NAME/, NAME.tokens.npy, NAME.logits.npy (what
  transformers computes from the FP8 checkpoint) and NAME_dequantized/ (its weights, fp32)."""
  import shutil
  import numpy as np
  torch = _torch()
  from transformers import AutoConfig, AutoModelForCausalLM
  made = {}
  for name, (base, strategy, block, int_bits) in sorted(FP8_MODELS.items()):
    hf_dir = os.path.join(out_dir, name)
    quantize_fp8(os.path.join(out_dir, base), hf_dir, strategy, block, int_bits)
    shutil.copy(os.path.join(out_dir, f"{base}.tokens.npy"),
                os.path.join(out_dir, f"{name}.tokens.npy"))
    tokens = np.load(os.path.join(out_dir, f"{name}.tokens.npy"))
    if int_bits:
      # transformers' own load keeps the attention compressed and cannot be saved: the
      # reference is compressed-tensors' unpack and dequantize of every weight, and
      # transformers' logits from those weights
      _dequantize_packed(hf_dir, hf_dir + "_dequantized", int_bits)
      model, info = _load(hf_dir + "_dequantized")
      np.save(os.path.join(out_dir, f"{name}.logits.npy"), _logits(model, tokens))
      made[name] = hf_dir
      continue
    model, info = _load(hf_dir)           # without a GPU, transformers dequantizes on load
    if info:
      raise RuntimeError(f"transformers did not read {hf_dir} whole: {info}")
    np.save(os.path.join(out_dir, f"{name}.logits.npy"), _logits(model, tokens))
    # transformers cannot save a compressed-tensors model it loaded: its weights go into an
    # unquantized model of the same config instead, those it kept in float8 (modules with a bias)
    # dequantized as its forward does, value * scale in fp32
    state = model.state_dict()
    for key in [k for k in state if k.endswith(".weight_scale")]:
      weight, scale = key[:-len("_scale")], state.pop(key)
      if state[weight].dtype == torch.float8_e4m3fn:
        state[weight] = state[weight].to(torch.float32) * scale.to(torch.float32)
    plain = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(os.path.join(out_dir, base)), attn_implementation="eager")
    missing, unexpected = plain.to(model.dtype).load_state_dict(state, strict=False)
    if missing or unexpected:
      raise RuntimeError(f"{name}: dequantized weights do not fit: {missing} {unexpected}")
    plain.save_pretrained(hf_dir + "_dequantized")
    made[name] = hf_dir
  return made


def _dequantize_packed(hf_dir: str, out_dir: str, int_bits: int) -> None:
  """out_dir: the checkpoint at hf_dir with each packed weight replaced by compressed-tensors'
  own unpack_from_int32 and dequantize of it (in the scale's dtype, then fp32); config.json
  unquantized."""
  torch = _torch()
  from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
  from compressed_tensors.quantization import QuantizationArgs
  from compressed_tensors.quantization.lifecycle.forward import dequantize

  def edit(tensors: dict) -> dict:
    for packed in [k for k in tensors if k.endswith("_packed")]:
      name = packed[:-len("_packed")]
      shape = torch.Size(tensors.pop(name + "_shape").tolist())
      q = unpack_from_int32(tensors.pop(packed), int_bits, shape)
      scale = tensors.pop(name + "_scale")
      args = QuantizationArgs(num_bits=int_bits, type="int", symmetric=True, strategy="group",
                              group_size=shape[1] // scale.shape[1])
      tensors[name] = dequantize(q, scale, None, args=args).to(torch.float32)
    return tensors

  _rewrite_checkpoint(hf_dir, out_dir, edit, lambda config: config.pop("quantization_config"))


def logits(hf_dir: str, tokens: str, out: str) -> dict:
  import numpy as np
  model, info = _load(hf_dir)
  np.save(out, _logits(model, np.load(tokens)))
  return {"loading_info": info}


def gated_delta_net(config: dict, weights: str, inputs: str, out: str) -> dict:
  """transformers' Qwen3-Next linear attention layer (Qwen3NextGatedDeltaNet) of `config` with the
  tensors of the .npz `weights` (its own names), on the fp32 hidden states in `inputs`
  ([B, S, D] .npy) without a cache: its output to `out`."""
  _torch()
  from transformers import Qwen3NextConfig
  from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
  return _run_layer(Qwen3NextGatedDeltaNet(Qwen3NextConfig(**config), 0), weights, inputs, out)


def _run_layer(layer, weights: str, inputs: str, out: str) -> dict:
  """A transformers layer in fp32 with the tensors of the .npz `weights` (its own names), on the
  hidden states in `inputs` without a cache: its output to `out`."""
  import numpy as np
  torch = _torch()
  layer = layer.to(torch.float32).eval()
  with np.load(weights) as tensors:
    layer.load_state_dict({k: torch.from_numpy(tensors[k]) for k in tensors.files})
  with torch.no_grad():
    y = layer(torch.from_numpy(np.load(inputs)))
  np.save(out, y.numpy())
  return {"out": out}


COMMANDS = {"make": make, "logits": logits, "random_model": random_model,
            "token_losses": token_losses, "gated_delta_net": gated_delta_net}


def serve() -> None:
  channel = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)          # library prints go to stderr; stdout carries only replies
  for line in sys.stdin:
    if not line.strip():
      continue
    try:
      request = json.loads(line)
      reply = {"ok": True, **COMMANDS[request["cmd"]](**request.get("args", {}))}
    except Exception:   # reported to the caller, who fails the test with it
      reply = {"ok": False, "error": traceback.format_exc()}
    channel.write(json.dumps(reply) + "\n")
    channel.flush()


def main(argv: list[str]) -> int:
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TQDM_DISABLE", "1")
  if argv[:1] == ["serve"]:
    serve()
    return 0
  if argv[:1] == ["make"] and len(argv) == 2:
    print(json.dumps(make(argv[1])))
    return 0
  if argv[:1] == ["logits"] and len(argv) == 4:
    print(json.dumps(logits(*argv[1:])))
    return 0
  print(__doc__, file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
