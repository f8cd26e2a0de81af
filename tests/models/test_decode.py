"""KV-cached decoding (moejax.models.decode): every generated step's logits equal a full forward
pass over the same tokens, in fp32; sampling is reproducible for a fixed seed; a tiny nucleus is
greedy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.models import decode, olmoe
from moejax.sharding.hook import local_gather
from tests.helpers import tiny_config

NEW = 6


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(**{"routing.admission": "reroute"})     # admission is off when decoding
  return cfg, olmoe.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def prompt():
  return np.random.default_rng(0).integers(0, 256, (2, 5)).astype(np.int32)


# YaRN with a short original context, so the generated positions reach past it; DeepSeek's
# mscales scale cos and sin and latent attention's softmax.
YARN = {"model.rope_scaling": "yarn", "model.rope_factor": 4.0, "model.rope_original_max_len": 4,
        "model.rope_beta_fast": 8.0}


def _family_model(family):
  yarn = dict(YARN, **({"model.rope_mscale": 0.9, "model.rope_mscale_all_dim": 0.7}
                       if family == "deepseek_v32" else {}))
  if family == "deepseek_v32":   # 3 keys of the cache's 11 by an indexer of 8 heads
    yarn.update({"model.index_topk": 3, "model.index_heads": 8})
  if family in ("mellum", "granitemoe_swa", "cohere2_moe", "gpt_oss"):
    # a window the generated positions pass
    yarn["model.sliding_window"] = 3
  if family == "qwen3_next":  # a pattern twice: one scan of 2 x [linear, full]
    yarn["model.linear_layers"] = (0, 2)
  if family == "llama4":      # its own scaling; chunks and temperature steps the positions pass
    yarn = {"model.rope_original_max_len": 4, "model.attention_chunk": 4,
            "model.nope_temperature_floor": 2}
  cfg = tiny_config(family, **{"model.init_std": 0.1}, **yarn)   # logits that vary
  return cfg, olmoe.init_params(cfg, jax.random.key(1))


@pytest.mark.parametrize("family", ["olmoe",
                                    "mellum", "granitemoe_swa", "cohere2_moe", "llama4",
                                    "deepseek_v32", "qwen3_next", "gpt_oss"])
def test_cached_logits_equal_the_full_forward(family, model, prompt):
  """OLMoE; Mellum: the sliding layers' own plain RoPE beside the global layer's YaRN; Granite SWA:
  attention sinks over the cache, Granite's four multipliers and a shared MLP; Cohere2-MoE:
  parallel blocks (the cached step's attention and MLP read one LayerNorm's output),
  neighbour-pair rotary (the cache holds
  k permuted; ERNIE-4.5's), two layers sliding within 3 tokens of the cache and one unrotated
  (EXAONE-MoE's kinds); Llama 4: chunks of 4 the cache masks, the unrotated layer's query
  temperature at the cached positions, the unscaled QK-norm of the rotated q and k, Llama 3's
  RoPE scaling, the experts' inputs weighted; DeepSeek-V3.2: DeepSeek-V3's tiny preset (latent
  attention's per-head keys with the shared rotary part and narrower values, a dense layer
  before the MoE ones, grouped sigmoid routing; run alone here until measured redundant) with
  each query's 3 best keys by the indexer, whose keys the cache holds beside the attention's;
  Qwen3-Next: [linear, full] twice (one scan over the period, `olmoe.layer_scans`), Gated
  DeltaNet layers whose state (the convolution's last inputs, the memory) the prompt leaves by chunks and
  each new token moves by the recurrence, beside the softmax layers' keys and values and their
  output gate, computed from the new tokens alone (MiniCPM5-MoE's, not run again), a quarter
  of each head rotated (GLM-4.5's half, run here until measured redundant), zero-centered
  norms. (FlexOlmo's norms on the sublayers' outputs, AfMoE's sandwich norms and its gate's own
  projection, and Hunyuan's QK-norm of the rotated
  q and k, which the cache holds normed, and Qwen2-MoE's qkv biases and gated shared expert
  beside a grouped-query cache of 2 kv heads, are in `sublayers` and `qkv`, which the cached
  step shares; each was run here equal to the full forward until measured redundant. Flint's and
  Kolibri's layers hold no option
  these do not; gpt-oss's output bias is in `project_out`, which the cached step shares, and
  its experts are the forward's.) gpt-oss: sliding and full layers alternating, one scan of
  2 x [sliding within 3 tokens, full], attention sinks over the cache. All but OLMoE and Llama 4 with YaRN RoPE."""
  cfg, params = model if family == "olmoe" else _family_model(family)
  tokens_BxN, logits_BxNxV = decode.generate(cfg, params, prompt, max_new_tokens=NEW)
  assert tokens_BxN.shape == (2, prompt.shape[1] + NEW)
  np.testing.assert_array_equal(tokens_BxN[:, :prompt.shape[1]], prompt)
  gather = functools.partial(local_gather, dtype=jnp.float32)
  full_BxNxV, _ = jax.jit(lambda p, x: olmoe.forward(decode.without_admission(cfg), p, x,
                                                      gather=gather))(params, tokens_BxN[:, :-1])
  np.testing.assert_allclose(logits_BxNxV, full_BxNxV[:, prompt.shape[1] - 1:], rtol=1e-5,
                             atol=1e-5)
  # Greedy: each new token is the argmax of its step's logits.
  np.testing.assert_array_equal(tokens_BxN[:, prompt.shape[1]:], np.argmax(logits_BxNxV, -1))


def test_a_model_of_linear_layers_alone_decodes(prompt):
  """Every layer Mamba-2 (Granite-4.0-H's linear layers; Gated DeltaNet's decode above): the
  cache holds no keys (its softmax arrays have no layers), only the linear layers' state (the
  biased convolution's last inputs, each head's memory), and each generated step's logits equal
  the full forward's."""
  cfg = tiny_config("granitemoehybrid", **{"model.init_std": 0.1, "model.num_layers": 2,
                                           "model.linear_layers": (0, 1),
                                           "model.nope_layers": ()})
  params = olmoe.init_params(cfg, jax.random.key(2))
  assert decode.init_cache(cfg, 2, 8).k_LxBxTxGxDk.shape[0] == 0
  tokens_BxN, logits_BxNxV = decode.generate(cfg, params, prompt, max_new_tokens=3)
  gather = functools.partial(local_gather, dtype=jnp.float32)
  full_BxNxV, _ = olmoe.forward(decode.without_admission(cfg), params, tokens_BxN[:, :-1],
                                gather=gather)
  np.testing.assert_allclose(logits_BxNxV, full_BxNxV[:, prompt.shape[1] - 1:], rtol=1e-5,
                             atol=1e-5)


def test_sampling_is_reproducible_for_a_seed(model, prompt):
  cfg, params = model
  sample = functools.partial(decode.generate, cfg, params, prompt, max_new_tokens=NEW,
                             temperature=1.0, top_p=0.9)
  first, _ = sample(seed=3)
  again, _ = sample(seed=3)
  other, _ = sample(seed=4)
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)
  greedy, _ = decode.generate(cfg, params, prompt, max_new_tokens=NEW)
  nucleus_of_one, _ = sample(seed=3, top_p=1e-6)       # only the most likely token is left
  np.testing.assert_array_equal(nucleus_of_one, greedy)


def test_ids_past_the_tokenizer_s_vocabulary_are_never_sampled(model, prompt):
  """A model's vocabulary padded past its tokenizer's (the tiny preset's 320 ids, the bytes'
  257): ids no text decodes to were sampled at temperature 1 and vanished from the output.
  With `vocab_limit` none is, at the same logits."""
  cfg, params = model
  limit = 257
  run = functools.partial(decode.generate, cfg, params, prompt, max_new_tokens=NEW,
                          temperature=5.0)            # a flat distribution reaches every id
  free, logits = run(seed=0)
  limited, limited_logits = run(seed=0, vocab_limit=limit)
  new = np.asarray(free)[:, prompt.shape[1]:]
  assert cfg.model.vocab_size > limit and (new >= limit).any()      # the premise
  assert (np.asarray(limited)[:, prompt.shape[1]:] < limit).all()
  np.testing.assert_array_equal(np.asarray(logits)[:, 0], np.asarray(limited_logits)[:, 0])


def test_stops_when_every_row_has_ended(model, prompt):
  cfg, params = model
  greedy, _ = decode.generate(cfg, params, prompt[:1], max_new_tokens=NEW)
  generated = np.asarray(greedy[0, prompt.shape[1]:])
  eos = int(generated[1])                               # the second generated token
  ends = int(np.argmax(generated == eos)) + 1          # where it first appears
  stopped, logits = decode.generate(cfg, params, prompt[:1], max_new_tokens=NEW, eos_id=eos)
  np.testing.assert_array_equal(stopped, greedy[:, :prompt.shape[1] + ends])
  assert logits.shape[1] == ends < NEW


def test_a_row_that_ended_keeps_emitting_eos(model, prompt):
  cfg, params = model
  greedy, _ = decode.generate(cfg, params, prompt, max_new_tokens=NEW)
  eos = int(greedy[0, prompt.shape[1]])                  # row 0's first token
  tokens, _ = decode.generate(cfg, params, prompt, max_new_tokens=NEW, eos_id=eos)
  row0 = np.asarray(tokens[0, prompt.shape[1]:])
  assert np.all(row0 == eos)
  generated1 = np.asarray(greedy[1, prompt.shape[1]:])
  if eos not in generated1:                              # row 1 ran to the end, unchanged
    np.testing.assert_array_equal(tokens[1], greedy[1])


def test_tokens_beyond_the_cache_are_refused(model):
  cfg, params = model
  cache = decode.init_cache(cfg, 1, 4)
  with pytest.raises(ValueError, match="do not fit a KV cache of 4"):
    decode.forward_cached(decode.without_admission(cfg), decode.cast_params(params, jnp.float32),
                          jnp.zeros((1, 5), jnp.int32), cache, jnp.int32(0))
  # Fewer tokens than the cache, from a start too late for them (the writes clamped to the
  # cache's end: logits 0.18 off the full forward, no error).
  with pytest.raises(ValueError, match=r"^start=3 \+ 2 new tokens do not fit a KV cache of 4"):
    decode.forward_cached(decode.without_admission(cfg), decode.cast_params(params, jnp.float32),
                          jnp.zeros((1, 2), jnp.int32), cache, 3)
