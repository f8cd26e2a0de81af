"""Model shapes for the iteration-time model: parameter counts per layer and group, FLOPs inputs.

A `ModelShape` is what the model needs of a decoder: widths, layer pattern, experts. moejax's own
presets become one with `shape_of(cfg)` (a `moejax.config.Config`); the models of the papers'
measured points that moejax has no preset for are perf-only records here (`SHAPES`), each citing
its published config. Counts assume SwiGLU experts (three matrices) and untied or tied
embeddings as the record says.

Letters: D d_model, F expert hidden, E experts, K top-k, V vocabulary, H heads, Hk kv heads.
"""
from __future__ import annotations

import dataclasses

PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed ZeRO-3 keeps parameters with fewer elements than this unpartitioned
(`stage3_param_persistence_threshold`, default 1e5): they are never fetched."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
  name: str
  d_model: int
  num_layers: int
  vocab_size: int
  num_heads: int
  head_dim: int
  num_experts: int
  top_k: int
  expert_hidden: int
  num_kv_heads: int = 0
  """0: as num_heads (MHA)."""
  v_head_dim: int = 0
  """0: as head_dim."""
  attention: str = "gqa"
  """"gqa" (MHA when kv heads == heads) or "mla" (DeepSeek-V2/V3 latent attention)."""
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_rope_dim: int = 0
  """MLA: the rotary part of head_dim (head_dim = nope + rope)."""
  score_bias: bool = False
  """A per-expert selection bias in the router (DeepSeek-V3), E more parameters per layer."""
  qk_norm: bool = False
  qk_norm_per_head: bool = False
  """QK-norm scales of one head's width (Qwen3) rather than of all heads' (OLMoE)."""
  qkv_bias: bool = False
  attention_out_bias: bool = False
  """A bias on the attention's output projection (gpt-oss)."""
  expert_bias: bool = False
  """Biases on each expert's projections (gpt-oss): 2F + D more per expert."""
  router_bias: bool = False
  """A trained bias in the router's logits (gpt-oss): E more per layer."""
  sliding_window: int = 0
  """Keys a query of a sliding layer sees (0: none slides)."""
  sliding_layers: int = 0
  """How many layers slide within sliding_window."""
  attention_chunk: int = 0
  """Tokens of one attention chunk (Llama 4's; 0: none)."""
  chunked_layers: int = 0
  """How many layers attend within their chunk."""
  index_heads: int = 0
  """DeepSeek sparse attention's indexer (DeepSeek-V3.2): its query heads (0: none)."""
  index_head_dim: int = 0
  index_loss: bool = False
  """The indexer trains by its KL loss, which reads the attention's distribution (its q.k again)."""
  attention_gate: bool = False
  """A sigmoid output gate on the attention (MiniCPM5-MoE): the q projection twice as wide."""
  attention_sinks: bool = False
  """A sink logit per query head (gpt-oss, Granite SWA)."""
  attention_gate_own: bool = False
  """The output gate's weight its own projection (AfMoE), which has no bias."""
  linear_layers: tuple = ()
  """Indices of the layers with Gated DeltaNet linear attention (Qwen3-Next), of the widths
  below; the others softmax attention."""
  linear_kind: str = "gated_deltanet"   # or "mamba2" (model.linear_kind: Granite-4.0-H's)
  linear_key_heads: int = 0
  linear_value_heads: int = 0
  linear_key_dim: int = 0
  linear_value_dim: int = 0
  linear_conv_taps: int = 4
  residual_norms: int = 2
  """Norms of one layer on the residual stream (4 with AfMoE's sandwich norms, 1 in Cohere's
  parallel block)."""
  shared_gate: bool = False
  """A sigmoid gate (one D-vector) on the shared expert (Qwen2-MoE)."""
  shared_hidden: int = 0
  """Total hidden width of the shared experts (0: none)."""
  dense_layers: int = 0
  """Leading layers with a dense MLP instead of experts."""
  dense_hidden: int = 0
  tied_embeddings: bool = False
  source: str = ""

  # ---------------------------------------------------------------- counts
  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def moe_layers(self) -> int:
    return self.num_layers - self.dense_layers

  def attention_matrices(self) -> list[int]:
    """Element counts of the attention weight matrices of one layer."""
    d, h = self.d_model, self.num_heads
    vd = self.v_head_dim or self.head_dim
    if self.attention == "mla":
      nope = self.head_dim - self.qk_rope_dim
      q = ([d * self.q_lora_rank, self.q_lora_rank * h * self.head_dim] if self.q_lora_rank
           else [d * h * self.head_dim])
      return q + [d * (self.kv_lora_rank + self.qk_rope_dim),
                  self.kv_lora_rank * h * (nope + vd), h * vd * d]
    q = d * h * self.head_dim * (2 if self.attention_gate else 1)
    return [q, d * self.kv_heads * self.head_dim, d * self.kv_heads * vd, h * vd * d]

  def attention_params(self) -> int:
    q_bias = self.num_heads * (2 if self.attention_gate and not self.attention_gate_own else 1)
    bias = (q_bias + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
    return (sum(self.attention_matrices()) + bias + (self.num_heads if self.attention_sinks else 0)
            + (self.d_model if self.attention_out_bias else 0))

  def linear_attention_matrices(self) -> list[int]:
    """Element counts of a linear-attention layer's weight matrices: q, k, v, z, b, a and the
    output projection (Mamba-2: z, x, B, C, dt and the output projection)."""
    d, hv = self.d_model, self.linear_value_heads
    kw, vw = self.linear_key_heads * self.linear_key_dim, hv * self.linear_value_dim
    if self.linear_kind == "mamba2":
      return [d * vw, d * vw, d * kw, d * kw, d * hv, vw * d]
    return [d * kw, d * kw, d * vw, d * vw, d * hv, d * hv, vw * d]

  def linear_attention_params(self) -> int:
    """A linear-attention layer's weights: its matrices and the convolution's taps (Mamba-2's
    and their biases)."""
    kw = self.linear_key_heads * self.linear_key_dim
    vw = self.linear_value_heads * self.linear_value_dim
    taps = self.linear_conv_taps + (self.linear_kind == "mamba2")
    return sum(self.linear_attention_matrices()) + taps * (2 * kw + vw)

  def indexer_params(self) -> int:
    """DeepSeek-V3.2's indexer of one layer: q from the q latent, one key head with its
    LayerNorm (scale and bias), a weight per head."""
    hi, di = self.index_heads, self.index_head_dim
    return self.q_lora_rank * hi * di + self.d_model * (di + hi) + 2 * di if hi else 0

  def norm_params(self, linear: bool = False) -> int:
    """Layer norms of one layer (two or four, plus QK-norms, or latent attention's latent
    norms; linear attention's output norm and its decay's two values per value head; Mamba-2's
    gated norm over every head and its three values per head)."""
    extra = 0
    if linear and self.linear_kind == "mamba2":
      extra = self.linear_value_heads * (self.linear_value_dim + 3)
    elif linear:
      extra = self.linear_value_dim + 2 * self.linear_value_heads
    elif self.attention == "mla":
      extra = self.q_lora_rank + self.kv_lora_rank
    elif self.qk_norm:
      extra = (2 * self.head_dim if self.qk_norm_per_head
               else (self.num_heads + self.kv_heads) * self.head_dim)
    return self.residual_norms * self.d_model + extra

  def expert_params(self) -> int:
    """One routed expert."""
    bias = 2 * self.expert_hidden + self.d_model if self.expert_bias else 0
    return 3 * self.d_model * self.expert_hidden + bias

  def router_params(self) -> int:
    return self.d_model * self.num_experts + self.num_experts * (self.score_bias
                                                                 + self.router_bias)

  def shared_params(self) -> int:
    return 3 * self.d_model * self.shared_hidden + (self.d_model if self.shared_gate else 0)

  def dense_params(self) -> int:
    return 3 * self.d_model * self.dense_hidden

  def embedding_params(self) -> int:
    return self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)

  def layer_groups(self, moe: bool = True, linear: bool = False) -> dict[str, int]:
    """{group: elements} of one layer (`linear`: one with linear attention); groups as moejax's
    codec reports them."""
    if linear:
      out = {"attention": self.linear_attention_params(), "norms": self.norm_params(True)}
    else:
      out = {"attention": self.attention_params(), "norms": self.norm_params()}
    if self.index_heads and not linear:
      out["indexer"] = self.indexer_params()
    if moe:
      out["router"] = self.router_params()
      out["experts"] = self.num_experts * self.expert_params()
      if self.shared_hidden:
        out["shared_experts"] = self.shared_params()
    else:
      out["dense"] = self.dense_params()
    return out

  def is_linear(self, layer: int) -> bool:
    return layer in self.linear_layers

  def layers(self):
    """(moe, linear) of each layer: the leading dense_layers dense."""
    return [(i >= self.dense_layers, self.is_linear(i)) for i in range(self.num_layers)]

  def moe_pools(self) -> tuple | None:
    """fssdp's storage pools as rows of [MoE layers, E] (`moejax.placement.reshard`, Pools): the
    MoE layers of each attention kind, where there are both; None: one pool."""
    kinds = [linear for moe, linear in self.layers() if moe]
    if len(set(kinds)) < 2:
      return None
    return tuple(tuple(i for i, k in enumerate(kinds) if k == kind) for kind in (False, True))

  def total_params(self) -> int:
    return (sum(sum(self.layer_groups(moe, linear).values()) for moe, linear in self.layers())
            + self.embedding_params() + self.d_model)

  def active_params(self) -> int:
    """Weights one token's forward multiplies by (lm head included, embedding lookup not)."""
    total = self.vocab_size * self.d_model
    for moe, linear in self.layers():
      total += (self.linear_attention_params() if linear
                else self.attention_params() + self.indexer_params())
      total += (self.router_params() + self.top_k * self.expert_params() + self.shared_params()
                if moe else self.dense_params())
    return total

  def modules_per_layer(self, moe: bool = True, linear: bool = False) -> dict[str, int]:
    """{group: parameter tensors DeepSpeed ZeRO-3 fetches one by one} of one layer: one per
    weight matrix at or above `PERSISTENCE_THRESHOLD` elements (each expert is 3 Linear
    modules in the Hugging Face implementations)."""
    big = lambda n: int(n >= PERSISTENCE_THRESHOLD)
    matrices = self.linear_attention_matrices() if linear else self.attention_matrices()
    out = {"attention": sum(big(n) for n in matrices)}
    if moe:
      out["router"] = big(self.router_params())
      out["experts"] = 3 * self.num_experts * big(self.d_model * self.expert_hidden)
      if self.shared_hidden:
        out["shared_experts"] = 3
    else:
      out["dense"] = 3
    return out

  def with_layers(self, num_layers: int, dense_layers: int | None = None) -> ModelShape:
    """The same shapes with fewer layers (the papers' L=2/L=4 runs); leading dense layers kept
    up to `dense_layers` (default: as many as fit, like a truncated Hugging Face config)."""
    dense = min(self.dense_layers, num_layers) if dense_layers is None else dense_layers
    return dataclasses.replace(self, num_layers=num_layers, dense_layers=dense,
                               name=f"{self.name} (L={num_layers})")


def shape_of(cfg) -> ModelShape:
  """The shape record of a moejax `Config` (any family: grouped-query, multi-head or latent
  attention, QK-norm or none, shared experts or none, leading dense layers, a score bias, tied
  or untied embeddings; SwiGLU experts)."""
  m, moe = cfg.model, cfg.moe
  mla = dict(attention="mla", q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
             qk_rope_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
             index_heads=m.index_heads if m.index_topk else 0,
             index_head_dim=m.index_head_dim if m.index_topk else 0,
             index_loss=bool(m.index_topk and m.train_indexer)) if m.kv_lora_rank else {}
  return ModelShape(
      name=getattr(cfg, "name", "") or f"moejax d{m.d_model} L{m.num_layers} E{moe.num_experts}",
      d_model=m.d_model, num_layers=m.num_layers, vocab_size=m.vocab_size,
      num_heads=m.num_heads, head_dim=m.head_dim,
      num_kv_heads=getattr(m, "num_kv_heads", 0) or 0,
      num_experts=moe.num_experts, top_k=moe.top_k, expert_hidden=moe.expert_hidden,
      shared_hidden=getattr(moe, "shared_expert_hidden", 0) or 0,
      dense_layers=len(m.dense_layers),
      dense_hidden=getattr(m, "dense_hidden", 0) or 0,
      qk_norm=m.qk_norm in ("full", "head"), qk_norm_per_head=m.qk_norm == "head",
      qkv_bias=m.qkv_bias, attention_chunk=m.attention_chunk,
      chunked_layers=len(m.chunked_layers),
      attention_gate=m.attention_gate, sliding_window=m.sliding_window,
      residual_norms={"sandwich": 4, "parallel": 1}.get(m.norm_position, 2),
      attention_sinks=m.attention_sinks, attention_gate_own=m.attention_gate_own,
      sliding_layers=len(m.sliding_layers), shared_gate=moe.shared_expert_gate,
      tied_embeddings=m.tie_embeddings, score_bias=moe.score_bias,
      attention_out_bias=m.attention_out_bias, expert_bias=moe.expert_bias,
      router_bias=moe.router_bias, source="moejax config",
      linear_layers=tuple(m.linear_layers), linear_kind=m.linear_kind,
      linear_key_heads=m.linear_key_heads,
      linear_value_heads=m.linear_value_heads, linear_key_dim=m.linear_key_dim,
      linear_value_dim=m.linear_value_dim, linear_conv_taps=m.linear_conv_taps, **mla)


def _olmoe_1b7b() -> ModelShape:
  # Same numbers as configs/olmoe.py:1b7b (kept here so the perf package needs no config file;
  # tests/perf checks shape_of(get_config("1b7b")) gives this record).
  return ModelShape(
      "OLMoE-1B-7B", d_model=2048, num_layers=16, vocab_size=50304, num_heads=16, head_dim=128,
      num_experts=64, top_k=8, expert_hidden=1024, qk_norm=True,
      source="configs/olmoe.py:1b7b (allenai/OLMoE-1B-7B-0924 config.json)")


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    _olmoe_1b7b(),
    ModelShape("DeepSeek-MoE-16B", d_model=2048, num_layers=28, vocab_size=102400, num_heads=16,
               head_dim=128, num_experts=64, top_k=6, expert_hidden=1408, shared_hidden=2 * 1408,
               dense_layers=1, dense_hidden=10944,
               source="deepseek-ai/deepseek-moe-16b-base config.json: 64 routed experts top-6 of "
                      "width 1408, 2 shared, first layer dense (10944)"),
    ModelShape("Qwen2-57B-A14B", d_model=3584, num_layers=28, vocab_size=151936, num_heads=28,
               num_kv_heads=4, head_dim=128, num_experts=64, top_k=8, expert_hidden=2560,
               shared_hidden=20480,
               source="Qwen/Qwen2-57B-A14B config.json: 64 experts top-8 of width 2560, shared "
                      "expert 20480, GQA 28/4 (CIERA Sec. 2 says 28 fine-grained experts; the "
                      "published config has 64)"),
    ModelShape("MiniCPM-MoE-8x2B", d_model=2304, num_layers=40, vocab_size=122753,
               num_heads=36, head_dim=64, num_experts=8, top_k=2, expert_hidden=5760,
               tied_embeddings=True,
               source="openbmb/MiniCPM-MoE-8x2B config.json: 40 layers, d 2304, 36 heads, 8 "
                      "experts top-2 of width 5760, shared input/output embedding"),
    ModelShape("Mixtral-8x7B", d_model=4096, num_layers=32, vocab_size=32000, num_heads=32,
               num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_hidden=14336,
               source="mistralai/Mixtral-8x7B-v0.1 config.json"),
    ModelShape("Llama-4-Scout-17B-16E", d_model=5120, num_layers=48, vocab_size=202048,
               num_heads=40, num_kv_heads=8, head_dim=128, num_experts=16, top_k=1,
               expert_hidden=8192, shared_hidden=8192, attention_chunk=8192,
               chunked_layers=36,
               source="meta-llama/Llama-4-Scout-17B-16E config.json (text model): every layer "
                      "MoE, 16 experts top-1 plus one shared expert of width 8192, three layers "
                      "of four within chunks of 8192 (configs/llama4.py:scout)"),
    ModelShape("DeepSeek-V3", d_model=7168, num_layers=61, vocab_size=129280, num_heads=128,
               head_dim=192, v_head_dim=128, attention="mla", q_lora_rank=1536,
               kv_lora_rank=512, qk_rope_dim=64, num_experts=256, top_k=8, expert_hidden=2048,
               shared_hidden=2048, dense_layers=3, dense_hidden=18432, score_bias=True,
               source="deepseek-ai/DeepSeek-V3 config.json; Themis Table 1 (d 7168, d_ffn 2048, "
                      "seq 4096, 4 experts per GPU, top-8)"),
    ModelShape("Phi-3.5-MoE", d_model=4096, num_layers=32, vocab_size=32064, num_heads=32,
               num_kv_heads=8, head_dim=128, num_experts=16, top_k=2, expert_hidden=6400,
               source="microsoft/Phi-3.5-MoE-instruct config.json; Themis Table 1 (d 4096, "
                      "d_ffn 6400, seq 4096, 1 expert per GPU, top-2)"),
)}


def get_shape(name: str) -> ModelShape:
  if name not in SHAPES:
    raise ValueError(f"unknown model shape {name!r} (valid: {', '.join(SHAPES)})")
  return SHAPES[name]
