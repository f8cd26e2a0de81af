"""FSSDP in the MoE block: sparse materialization of hot experts and their dispatch.

Letters: T tokens here, K experts per token, E experts, L layers, N devices, El = E/N,
S = L*El storage slots per device, C the most experts one device owns in one layer
(fssdp.max_per_layer), M replica slots per device, D width, F expert hidden width.

Every expert is owned whole by one device, with its optimizer state; `Owners` says which (the
owner table of `moejax.placement.reshard`, heterogeneous across layers). Without one, expert
e is owned by device e // El, like `ep`. `owned_windows` turns a device's S stored slots into
[L, C] per-layer windows of its owned experts (a local gather, no communication; its gradient
scatters back into the slots). Each step and layer:
  1. `materialize`: plan replicas from the *predicted* loads (`planner.materialize_plan`,
     preferring, within 2% of the best straggler, the devices that held the same expert last
     step: the replica state's `held`, which every fssdp run keeps) and fetch them with
     SparseAllGather, before the layer's attention, so the transfer can hide behind it. SparseAllGather is one `psum_scatter` of an [N, M, ...] buffer in which each
     owner fills the slots that hold its experts: device d receives its M replica slots. Its
     transpose (the backward) is an `all_gather` of the replicas' gradients in fp32, of which each
     owner keeps and sums its own rows in fp32: SparseReduceScatter. Only gradients move;
     optimizer state never. With the replica codec (`fssdp.replica_codec`,
     `moejax.codec.replicas`) a device that held an expert last step receives it as a delta
     patch against its copy (`coded_sparse_all_gather`: uint32 rows, each a patch or a plain
     expert), bit-exact either way.
  2. After gating, every device learns all devices' routing counts (one all_gather of N x E
     ints) and computes the same balanced assignment of tokens to holders
     (`planner.balanced_send`); tokens go local first, then within the node, then across.
     With `calibrate`, the plan is re-made from the actual counts and adopted (with a second,
     late SparseAllGather of only the replicas a device does not hold yet, `new_replicas`)
     when its modelled straggler is lower by a margin. The re-plan prefers the first plan's
     holders the same way: a replica it keeps moves nothing.
  3. The exchange is ep's `all_to_all` with a destination and the expert's local group there
     (owned experts 0..C-1 by their rank on the owner, replica slots C..C+M-1).
On XLA:CPU the static buffers move their capacity (N*M expert slots for SpAG); on GPU/TPU
`ragged_all_to_all` moves only the filled slots (`ragged_plan`, chosen by
`lax.platform_dependent`), and the token exchange only the filled rows
(`dispatch.send_blocks`). Metrics report capacity and fill. The planner lets one owner fill at
most Q = `fssdp.owner_sends` slots (`owner_sends`), so the ragged forms' send rows and
SparseReduceScatter's fp32 receive rows are Q per device, not N*M: bounded as devices grow.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moejax import profiling
from moejax.codec import bits
from moejax.codec import replicas as replicas_lib
from moejax.placement.dispatch import Dispatch, exchange
from moejax.placement.experts import SWIGLU, ExpertFn
from moejax.routing import router as router_lib
from moejax.sharding.prefetch import kept_for_backward
from moejax.placement import ownership, planner


class Owners(NamedTuple):
  """One layer's (or, stacked, every layer's) ownership: owner_E, the device owning each expert,
  and rank_E, the expert's index among the experts of this layer its owner holds."""
  owner_E: jax.Array
  rank_E: jax.Array


def even_owners(num_experts: int, num_devices: int) -> Owners:
  """The even start (`ownership.initial_placement`) with each expert's rank on its owner."""
  owner_E = jnp.asarray(ownership.initial_placement(1, num_experts, num_devices)[0])
  return Owners(owner_E, jnp.arange(num_experts, dtype=jnp.int32) % (num_experts // num_devices))


def owned_windows(owner_LxE, local_w_LxElxR, me, *, num_devices: int, max_per_layer: int):
  """(Owners stacked over layers, windows [L, C, ...]): this device's experts of each layer, read
  from its S stored slots (see `moejax.placement.reshard`); `local_w_LxElxR` may be a pytree
  of such arrays. Row c of layer l holds the expert of rank c; rows past the layer's count hold
  other slots and are never addressed."""
  num_layers, num_experts = owner_LxE.shape
  slots = num_layers * (num_experts // num_devices)
  onehot_QxN = jax.nn.one_hot(owner_LxE.reshape(-1), num_devices, dtype=jnp.int32)
  slot_Q = jnp.sum((jnp.cumsum(onehot_QxN, axis=0) - onehot_QxN) * onehot_QxN, axis=1)
  count_LxN = jnp.sum(onehot_QxN.reshape(num_layers, num_experts, num_devices), axis=1)
  start_LxN = jnp.cumsum(count_LxN, axis=0) - count_LxN          # first slot of each layer
  start_LxE = jnp.take_along_axis(start_LxN, owner_LxE, axis=1)
  rank_LxE = slot_Q.reshape(num_layers, num_experts) - start_LxE
  slot_LxC = jnp.minimum(start_LxN[:, me][:, None] + jnp.arange(max_per_layer)[None, :], slots - 1)
  windows = jax.tree.map(lambda w: w.reshape((slots,) + w.shape[2:])[slot_LxC], local_w_LxElxR)
  return Owners(owner_LxE, rank_LxE), windows


def sparse_all_gather(local_w_CxR, replica_expert_NxM, *, dispatch: Dispatch,
                      owners: Owners | None = None):
  """Replicas [M, ...] of the experts `replica_expert_NxM[me]` (E = empty slot -> zeros).
  `local_w_CxR` holds this device's experts by rank (`owners`; default: the even ownership).
  Its transpose, SparseReduceScatter, sums each owned expert's replica gradients in fp32."""
  n = dispatch.num_devices
  if owners is None:
    owners = even_owners(local_w_CxR.shape[0] * n, n)
  holder_NxM, rank_NxM = _slot_sources(replica_expert_NxM, owners, n)
  return _sparse_all_gather(local_w_CxR, holder_NxM, rank_NxM, dispatch.axis_names,
                            owner_sends(dispatch))


def owner_sends(dispatch: Dispatch) -> int:
  """Q: the most replica slots one owner fills (the planner's bound, `fssdp.owner_sends`): the
  ragged path's send rows and SparseReduceScatter's fp32 receive rows per device."""
  return planner.resolve_owner_sends(dispatch.owner_sends, dispatch.num_devices,
                                     dispatch.replica_slots)


def _slot_sources(replica_expert_NxM, owners: Owners, n: int):
  """(holder [N, M]: the device that fills each slot, N for an empty one; rank [N, M]: the
  expert's index among its owner's)."""
  e = owners.owner_E.shape[0]
  safe_NxM = jnp.minimum(replica_expert_NxM, e - 1)
  valid_NxM = replica_expert_NxM < e
  return (jnp.where(valid_NxM, owners.owner_E[safe_NxM], n),
          jnp.where(valid_NxM, owners.rank_E[safe_NxM], 0))


def _overfilled(holder_NxM, sends: int):
  """True when some owner fills more than `sends` slots. The ragged (GPU) forms' buffers hold
  `sends` rows, so they would move wrong rows; the planner never makes such a plan, and the
  collectives return NaN for one (on every platform, so CPU tests see it) rather than a silently
  wrong result."""
  n = holder_NxM.shape[0]
  if sends >= holder_NxM.size:
    return jnp.zeros((), jnp.bool_)
  count_N = jnp.zeros((n + 1,), jnp.int32).at[holder_NxM.reshape(-1)].add(1)[:n]
  return jnp.max(count_N) > sends


def _poisoned(x, over):
  return jnp.where(over, jnp.full((), jnp.nan, x.dtype), x)


def _masked(x_NxMxR, mine_NxM):
  mask = mine_NxM.reshape(mine_NxM.shape + (1,) * (x_NxMxR.ndim - 2))
  return jnp.where(mask, x_NxMxR, jnp.zeros((), x_NxMxR.dtype))


class RaggedPlan(NamedTuple):
  """Where each replica row travels in the ragged SparseAllGather (GPU), from the replicated
  plan alone. As owner, this device sends its rows in (destination, slot) order: `order` [Q]
  lists the flat (d, slot) indices it fills (then others', never sent: the planner lets one
  owner fill at most Q = `owner_sends` slots); `send_N` rows to each destination, from
  `start_N`, landing at `land_N` there. As receiver it gets `recv_N` rows from each owner,
  grouped by owner; received row j belongs in slot `slot_of_row[j]`, and SparseReduceScatter
  returns its rows' gradients to each owner at `back_N` there (where that owner's rows for this
  device started: read off the plan, no collective)."""
  order: jax.Array
  send_N: jax.Array
  start_N: jax.Array
  land_N: jax.Array
  recv_N: jax.Array
  slot_of_row: jax.Array
  back_N: jax.Array


def send_order(holder_NxM, me, sends: int | None = None):
  """[Q] int32: the flat (destination, slot) indices this owner fills, in that order, first
  (Q = `sends`, default N * M)."""
  n, m = holder_NxM.shape
  flat_NxM = jnp.arange(n * m, dtype=jnp.int32).reshape(n, m)
  order = jnp.argsort(jnp.where(holder_NxM == me, flat_NxM, n * m).reshape(-1), stable=True)
  return order[:sends].astype(jnp.int32)


def ragged_plan(holder_NxM, me, sends: int | None = None) -> RaggedPlan:
  n, m = holder_NxM.shape
  mine_NxM = holder_NxM == me
  order = send_order(holder_NxM, me, sends)
  send_N = jnp.sum(mine_NxM, axis=1, dtype=jnp.int32)
  # count_OxD[o, d]: slots of device d that owner o fills (the empty-slot holder n drops out).
  count_OxD = jnp.sum(jax.nn.one_hot(holder_NxM, n, dtype=jnp.int32), axis=1).T
  before_OxD = jnp.cumsum(count_OxD, axis=0) - count_OxD       # rows from lower owners first
  mine_M = holder_NxM[me]
  slot_of_row = jnp.argsort(jnp.where(mine_M < n, mine_M * m + jnp.arange(m), n * m),
                            stable=True)
  back_OxD = jnp.cumsum(count_OxD, axis=1) - count_OxD        # rows for lower devices first
  return RaggedPlan(order, send_N, jnp.cumsum(send_N) - send_N,
                    before_OxD[me], count_OxD[:, me], slot_of_row.astype(jnp.int32),
                    back_OxD[:, me])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _sparse_all_gather(local_w_CxR, holder_NxM, rank_NxM, axis_names, sends):
  """Device d receives its M slots, each filled by the owner of its expert (`holder`, the
  expert at `rank` among the owner's own; holder N: an empty slot, zeros). XLA:CPU: one
  psum_scatter of the [N, M, ...] buffer every owner fills with its rows; GPU/TPU: one
  `ragged_all_to_all` of the filled rows only (`ragged_plan`), from a send buffer of `sends`
  rows (no owner fills more: the planner's `owner_sends`)."""
  def static(local_w_CxR, holder_NxM, rank_NxM):
    # Bit patterns, summed as integers (one device fills each slot, the others send zeros): a
    # float sum would turn -0.0 into +0.0, and XLA:CPU's float collectives rewrite NaN payloads.
    me = lax.axis_index(axis_names)
    uint = jnp.dtype(f"uint{8 * local_w_CxR.dtype.itemsize}")
    send_NxMxR = _masked(lax.bitcast_convert_type(local_w_CxR, uint)[rank_NxM], holder_NxM == me)
    got = lax.psum_scatter(send_NxMxR, axis_names, scatter_dimension=0, tiled=False)
    return lax.bitcast_convert_type(got, local_w_CxR.dtype)

  def ragged(local_w_CxR, holder_NxM, rank_NxM):
    m = holder_NxM.shape[1]
    plan = ragged_plan(holder_NxM, lax.axis_index(axis_names), sends)
    rows = local_w_CxR[rank_NxM.reshape(-1)[plan.order]]
    out = jnp.zeros((m,) + local_w_CxR.shape[1:], local_w_CxR.dtype)
    got = lax.ragged_all_to_all(rows, out, plan.start_N, plan.send_N, plan.land_N, plan.recv_N,
                                axis_name=axis_names)
    return jnp.zeros_like(got).at[plan.slot_of_row].set(got)

  return _poisoned(lax.platform_dependent(local_w_CxR, holder_NxM, rank_NxM, cpu=static,
                                          default=ragged), _overfilled(holder_NxM, sends))


def _reduce_scatter_residuals(local_w_CxR, holder_NxM, rank_NxM):
  """What SparseReduceScatter needs of the forward: the slots' sources and an empty array with
  the owned experts' rows and dtype."""
  return holder_NxM, rank_NxM, jnp.zeros((local_w_CxR.shape[0], 0), local_w_CxR.dtype)


def _sparse_all_gather_fwd(local_w_CxR, holder_NxM, rank_NxM, axis_names, sends):
  return (_sparse_all_gather(local_w_CxR, holder_NxM, rank_NxM, axis_names, sends),
          _reduce_scatter_residuals(local_w_CxR, holder_NxM, rank_NxM))


def _sparse_reduce_scatter(axis_names, sends, res, g_MxR):
  """The replicas' gradients go home in fp32 (as the hook's reduce-scatter), where each owner
  sums those of its experts in fp32 and rounds once. XLA:CPU: an all_gather of every device's
  [M, ...] gradients, each owner keeping its rows; GPU/TPU: the ragged exchange reversed."""
  holder_NxM, rank_NxM, like_Cx0 = res
  shape = like_Cx0.shape[:1] + g_MxR.shape[1:]
  zeros_CxR = jnp.zeros(shape, jnp.float32)

  def static(g_MxR, holder_NxM, rank_NxM):
    me = lax.axis_index(axis_names)
    g_NxMxR = _masked(lax.all_gather(g_MxR, axis_names, axis=0), holder_NxM == me)
    return zeros_CxR.at[rank_NxM.reshape(-1)].add(g_NxMxR.reshape((-1,) + shape[1:]))

  def ragged(g_MxR, holder_NxM, rank_NxM):
    plan = ragged_plan(holder_NxM, lax.axis_index(axis_names), sends)
    back = jnp.zeros(plan.order.shape + shape[1:], jnp.float32)
    # Sent back in the order received; each row lands where its owner sent it from.
    rows = lax.ragged_all_to_all(
        g_MxR[plan.slot_of_row], back, jnp.cumsum(plan.recv_N) - plan.recv_N, plan.recv_N,
        plan.back_N, plan.send_N, axis_name=axis_names)
    return zeros_CxR.at[rank_NxM.reshape(-1)[plan.order]].add(rows)

  d_CxR = lax.platform_dependent(g_MxR.astype(jnp.float32), holder_NxM, rank_NxM, cpu=static,
                                 default=ragged)
  return _poisoned(d_CxR, _overfilled(holder_NxM, sends)).astype(like_Cx0.dtype), None, None


_sparse_all_gather.defvjp(_sparse_all_gather_fwd, _sparse_reduce_scatter)


class Coding(NamedTuple):
  """One layer's replica coding for this step (`moejax.codec.replicas`): the layer's state on
  this device, the owned experts' bit patterns now [C, R], their plain and patch rows [C, W] and
  every expert's patch format (0: none), agreed by all devices [E]."""
  state: dict
  bits_CxR: jax.Array
  plain_CxW: jax.Array
  patch_CxW: jax.Array
  choice_E: jax.Array


def prepare_coding(ws, state: dict, owners: Owners, codec: replicas_lib.ReplicaCodec,
                   axis_names) -> Coding:
  """Encodes this device's owned experts `ws` ([C, ...] matrices) once against last step's and
  agrees with the other owners on the patches' formats (one all_gather of 2 bits per expert)."""
  bits_CxR = replicas_lib.to_bits(ws, codec.layout)
  patch_CxW, choice_C = replicas_lib.encode(bits_CxR, state["prev"], codec)
  choice_NxC = replicas_lib.agree(choice_C, axis_names)
  return Coding(state, bits_CxR, replicas_lib.plain_rows(bits_CxR, codec), patch_CxW,
                choice_NxC[owners.owner_E, owners.rank_E])


def coded_sparse_all_gather(ws, replica_expert_NxM, coding: Coding, *, dispatch: Dispatch,
                            owners: Owners, codec: replicas_lib.ReplicaCodec):
  """`sparse_all_gather` of the three matrices `ws` at once, a slot whose device held its
  expert last step travelling as a patch (`moejax.codec.replicas`): (replicas, bit for bit
  those of `sparse_all_gather`; choice_NxM, each slot's patch format, 0 where it went plain).
  The backward is the same SparseReduceScatter."""
  holder_NxM, rank_NxM = _slot_sources(replica_expert_NxM, owners, dispatch.num_devices)
  choice_NxM, source_NxM = replicas_lib.hits(coding.state, replica_expert_NxM, coding.choice_E)
  me = lax.axis_index(dispatch.axis_names)
  cache_MxR = coding.state["cache"][source_NxM[me]]   # last step's copy under each slot
  out = _coded_gather(tuple(ws), holder_NxM, rank_NxM, choice_NxM, coding.plain_CxW,
                      coding.patch_CxW, cache_MxR, dispatch.axis_names, codec,
                      owner_sends(dispatch))
  return out, choice_NxM


class CodedRaggedPlan(NamedTuple):
  """The ragged exchange of coded rows, in `bits.CHUNK_WORDS`-word chunks, from replicated data
  alone (`coded_ragged_plan`). As owner: it sends the rows of the flat (destination, slot)
  indices `order_Q` (`send_order`: its own first), row q's `chunks_Q[q]` chunks (0 for another
  owner's) starting at chunk `start_Q[q]` of the send buffer; `send_N` chunks go to each
  destination from `offset_N`,
  landing at `land_N` there. As receiver: `recv_N` chunks from each owner; slot m's row starts
  at chunk `row_start_M[m]`. Chunks, not words: offsets in words pass 2^31 for a few slots of
  large experts (DeepSeek-V3's 22M words each: 98 slots)."""
  order_Q: jax.Array
  chunks_Q: jax.Array
  start_Q: jax.Array
  send_N: jax.Array
  offset_N: jax.Array
  land_N: jax.Array
  recv_N: jax.Array
  row_start_M: jax.Array


def coded_ragged_plan(holder_NxM, chunks_NxM, me, sends: int | None = None) -> CodedRaggedPlan:
  """A receiver's buffer holds its rows grouped by owner in device order, each owner's in slot
  order: the order in which owners send them (destination, then slot). `sends`: Q, the most
  slots one owner fills (default N * M)."""
  n, m = holder_NxM.shape
  mine_NxM = jnp.where(holder_NxM == me, chunks_NxM, 0)
  order_Q = send_order(holder_NxM, me, sends)
  flat_Q = mine_NxM.reshape(-1)[order_Q]
  send_N = jnp.sum(mine_NxM, axis=1)
  land_N = jnp.sum(jnp.where(holder_NxM < me, chunks_NxM, 0), axis=1)
  holder_M, chunks_M = holder_NxM[me], chunks_NxM[me]
  recv_N = jnp.sum(jnp.where(holder_M[None, :] == jnp.arange(n)[:, None], chunks_M[None, :], 0),
                   axis=1)
  slot_M = jnp.arange(m)
  before_MxM = (holder_M[None, :] < holder_M[:, None]) | (
      (holder_M[None, :] == holder_M[:, None]) & (slot_M[None, :] < slot_M[:, None]))
  row_start_M = jnp.sum(jnp.where(before_MxM, chunks_M[None, :], 0), axis=1)
  return CodedRaggedPlan(order_Q, flat_Q, jnp.cumsum(flat_Q) - flat_Q, send_N,
                         jnp.cumsum(send_N) - send_N, land_N, recv_N, row_start_M)


def pack_send_chunks(rows_QxUxK, chunks_Q, start_Q):
  """The owner's rows back to back: [Q * U, K] (each row's first `chunks_Q` chunks)."""
  q, u, k = rows_QxUxK.shape
  col_U = jnp.arange(u, dtype=jnp.int32)
  pos_QxU = jnp.where(col_U[None, :] < chunks_Q[:, None], start_Q[:, None] + col_U[None, :], q * u)
  return jnp.zeros((q * u, k), rows_QxUxK.dtype).at[pos_QxU.reshape(-1)].set(
      rows_QxUxK.reshape(q * u, k), mode="drop")


def unpack_recv_chunks(got_VxK, chunks_M, row_start_M, u: int):
  """The receiver's rows [M, U, K] from its packed buffer (zeros past each row's chunks)."""
  col_U = jnp.arange(u, dtype=jnp.int32)
  padded = jnp.concatenate([got_VxK, jnp.zeros((u,) + got_VxK.shape[1:], got_VxK.dtype)])
  rows_MxUxK = padded[row_start_M[:, None] + col_U[None, :]]
  return jnp.where((col_U[None, :] < chunks_M[:, None])[..., None], rows_MxUxK,
                   jnp.zeros((), got_VxK.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _coded_gather(ws, holder_NxM, rank_NxM, choice_NxM, plain_CxW, patch_CxW, cache_MxR,
                  axis_names, codec, sends):
  """Slot (d, m) receives its expert's patch row where `choice_NxM` > 0, else its plain row,
  from the slot's holder. XLA:CPU: one psum_scatter of a static [N, M, W] uint32 buffer;
  GPU/TPU: one `ragged_all_to_all` of the rows' words in chunks (`coded_ragged_plan`), from
  the `sends` rows an owner fills at most."""
  n, m = holder_NxM.shape
  w = codec.row_words
  k, u = bits.CHUNK_WORDS, bits.chunks(w)

  def rows_of(rank, choice, plain_CxW, patch_CxW):
    return jnp.where((choice > 0)[..., None], patch_CxW[rank], plain_CxW[rank])

  def static(holder_NxM, rank_NxM, choice_NxM, plain_CxW, patch_CxW):
    me = lax.axis_index(axis_names)
    rows_NxMxW = _masked(rows_of(rank_NxM, choice_NxM, plain_CxW, patch_CxW), holder_NxM == me)
    return lax.psum_scatter(rows_NxMxW, axis_names, scatter_dimension=0, tiled=False)

  def ragged(holder_NxM, rank_NxM, choice_NxM, plain_CxW, patch_CxW):
    me = lax.axis_index(axis_names)
    words_NxM = replicas_lib.slot_words(holder_NxM, choice_NxM, codec)
    chunks_NxM = bits.chunks(words_NxM)
    plan = coded_ragged_plan(holder_NxM, chunks_NxM, me, sends)
    q = plan.order_Q.shape[0]
    rows_QxW = rows_of(rank_NxM.reshape(-1)[plan.order_Q], choice_NxM.reshape(-1)[plan.order_Q],
                       plain_CxW, patch_CxW)
    rows_QxUxK = jnp.pad(rows_QxW, ((0, 0), (0, u * k - w))).reshape(q, u, k)
    send = pack_send_chunks(rows_QxUxK, plan.chunks_Q, plan.start_Q)
    got = lax.ragged_all_to_all(send, jnp.zeros((m * u, k), jnp.uint32), plan.offset_N,
                                plan.send_N, plan.land_N, plan.recv_N, axis_name=axis_names)
    # Past its words a row holds the sender's zero padding, as the static path's rows do.
    return unpack_recv_chunks(got, chunks_NxM[me], plan.row_start_M, u).reshape(m, u * k)[:, :w]

  got_MxW = lax.platform_dependent(holder_NxM, rank_NxM, choice_NxM, plain_CxW, patch_CxW,
                                   cpu=static, default=ragged)
  me = lax.axis_index(axis_names)
  bits_MxR = replicas_lib.decode(got_MxW, choice_NxM[me], cache_MxR, codec)
  over = _overfilled(holder_NxM, sends)
  return tuple(_poisoned(r, over) for r in replicas_lib.from_bits(bits_MxR, ws, codec.layout))


def _coded_gather_fwd(ws, holder_NxM, rank_NxM, choice_NxM, plain_CxW, patch_CxW, cache_MxR,
                      axis_names, codec, sends):
  likes = tuple(jnp.zeros((w.shape[0], 0), w.dtype) for w in ws)
  out = _coded_gather(ws, holder_NxM, rank_NxM, choice_NxM, plain_CxW, patch_CxW, cache_MxR,
                      axis_names, codec, sends)
  return out, (holder_NxM, rank_NxM, likes)


def _coded_gather_bwd(axis_names, codec, sends, res, g_ws):
  del codec
  holder_NxM, rank_NxM, likes = res
  d_ws = tuple(_sparse_reduce_scatter(axis_names, sends, (holder_NxM, rank_NxM, like), g)[0]
               for like, g in zip(likes, g_ws))
  return (d_ws, None, None, None, None, None, None)


_coded_gather.defvjp(_coded_gather_fwd, _coded_gather_bwd)


class Materialized(NamedTuple):
  """`materialize`'s result: the plan, the weights [C + M, ...] (owned by rank, then the
  replicas), the owners, and with the replica codec its `Coding` and each slot's patch format
  (0: the slot went plain); both None without the codec."""
  plan: planner.Plan
  weights: tuple
  owners: Owners
  coding: Coding | None = None
  choice_NxM: jax.Array | None = None


@profiling.scoped("replicas")
def materialize(predicted_load_E, *ws, dispatch: Dispatch, owners: Owners | None = None,
                replica_state: dict | None = None) -> Materialized:
  """This step's plan and weights. `ws` (the expert arrays, `moejax.placement.experts`) hold
  this device's experts of the layer by rank
  (`owners`; default: even, C = El). The plan prefers the devices that held an expert last step
  (`replica_state["held"]`); with `dispatch.replica_codec` those slots receive patches. The
  preference applies with the codec off too, so the plans, and so the losses, do not depend on
  the codec; it costs the modelled straggler at most `planner.PREFER_WITHIN`."""
  n = dispatch.num_devices
  if owners is None:
    owners = even_owners(ws[0].shape[0] * n, n)
  codec = dispatch.replica_codec
  coded = codec is not None and replica_state is not None
  held_ExN = None if replica_state is None else held_by_device(replica_state["held"],
                                                               owners.owner_E.shape[0])
  plan = kept_for_backward("fssdp_plan", lambda: planner.materialize_plan(
      predicted_load_E, owners.owner_E, num_devices=n,
      devices_per_node=dispatch.devices_per_node, replica_slots=dispatch.replica_slots,
      overlap_degree=dispatch.overlap_degree, prefer_ExN=held_ExN,
      owner_sends=dispatch.owner_sends))
  if not coded:
    weights = tuple(jnp.concatenate([w, sparse_all_gather(w, plan.replica_expert_NxM,
                                                          dispatch=dispatch, owners=owners)],
                                    axis=0) for w in ws)
    return Materialized(plan, weights, owners)
  coding = prepare_coding(ws, replica_state, owners, codec, dispatch.axis_names)
  reps, choice_NxM = coded_sparse_all_gather(ws, plan.replica_expert_NxM, coding,
                                             dispatch=dispatch, owners=owners, codec=codec)
  weights = tuple(jnp.concatenate([w, r], axis=0) for w, r in zip(ws, reps))
  return Materialized(plan, weights, owners, coding, choice_NxM)


def held_by_device(held_NxM, num_experts: int) -> jax.Array:
  """[E, N] bool: device n held a replica of expert e after last step (`held_NxM`, the replica
  state's: E or -1 for none)."""
  n, m = held_NxM.shape
  e_NxM = jnp.where(held_NxM >= 0, held_NxM, num_experts)
  out = jnp.zeros((num_experts + 1, n), jnp.bool_)
  return out.at[e_NxM, jnp.broadcast_to(jnp.arange(n)[:, None], (n, m))].set(True)[:num_experts]


def new_replicas(first_NxM, fresh_NxM, num_experts: int):
  """What a re-plan (`planner.calibrate`) must fetch: (need_NxM, the fresh plan with every
  replica its device already received from the first plan emptied (E); kept_NxM, those slots;
  source_NxM, the first plan's slot of the same device holding that expert). The planner orders
  a device's slots by when it adopted them, so a kept expert may sit in another slot."""
  same_NxMxM = ((fresh_NxM[:, :, None] == first_NxM[:, None, :])
                & (fresh_NxM[:, :, None] < num_experts))
  kept_NxM = jnp.any(same_NxMxM, axis=2)
  source_NxM = jnp.argmax(same_NxMxM, axis=2).astype(jnp.int32)
  return jnp.where(kept_NxM, num_experts, fresh_NxM), kept_NxM, source_NxM


@profiling.scoped("replicas")
def late_replicas(owned, first, first_NxM, fresh_NxM, *, dispatch: Dispatch, owners: Owners,
                  coding: Coding | None = None):
  """The replicas of a re-plan `fresh_NxM`, given those of the first plan `first_NxM` (`first`:
  this device's, [M, ...] per matrix; `owned`: its owned experts by rank). Only the replicas a
  device does not hold yet travel (`new_replicas`, coded like the first gather when `coding` is
  given); one it already received is copied from its first-plan slot. Every replica's gradient
  goes home by one SparseReduceScatter of the re-plan (`_home_gradients`), so each expert's
  replica gradients are summed in fp32 and rounded once, as a full gather of the re-plan would
  have them. Returns (replicas, bit for bit those of a full gather of `fresh_NxM`; need_NxM, the
  slots that travelled; choice_NxM, their patch formats, None without `coding`)."""
  n, e = dispatch.num_devices, owners.owner_E.shape[0]
  need_NxM, kept_NxM, source_NxM = new_replicas(first_NxM, fresh_NxM, e)
  values = tuple(lax.stop_gradient(w) for w in owned)   # the gradients take `_home_gradients`
  if coding is None:
    moved = tuple(sparse_all_gather(w, need_NxM, dispatch=dispatch, owners=owners)
                  for w in values)
    choice_NxM = None
  else:
    moved, choice_NxM = coded_sparse_all_gather(values, need_NxM, coding, dispatch=dispatch,
                                                owners=owners, codec=dispatch.replica_codec)
  me = lax.axis_index(dispatch.axis_names)
  kept_M, source_M = kept_NxM[me], source_NxM[me]
  holder_NxM, rank_NxM = _slot_sources(fresh_NxM, owners, n)
  reps = tuple(
      _home_gradients(jnp.where(kept_M.reshape((-1,) + (1,) * (r.ndim - 1)),
                                lax.stop_gradient(f)[source_M], r),
                      w, holder_NxM, rank_NxM, dispatch.axis_names, owner_sends(dispatch))
      for w, f, r in zip(owned, first, moved))
  return reps, need_NxM, choice_NxM


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _home_gradients(reps_MxR, local_w_CxR, holder_NxM, rank_NxM, axis_names, sends):
  """`reps_MxR` as they are, their gradients sent home to the owners of `local_w_CxR` by the
  SparseReduceScatter of the slots' (holder, rank): the backward of a SparseAllGather whose
  forward was assembled otherwise."""
  del local_w_CxR, holder_NxM, rank_NxM, axis_names, sends
  return reps_MxR


def _home_gradients_fwd(reps_MxR, local_w_CxR, holder_NxM, rank_NxM, axis_names, sends):
  del axis_names, sends
  return reps_MxR, _reduce_scatter_residuals(local_w_CxR, holder_NxM, rank_NxM)


def _home_gradients_bwd(axis_names, sends, res, g_MxR):
  d_CxR, _, _ = _sparse_reduce_scatter(axis_names, sends, res, g_MxR)
  return jnp.zeros_like(g_MxR), d_CxR, None, None


_home_gradients.defvjp(_home_gradients_fwd, _home_gradients_bwd)


def _replica_bytes(plan, choice_NxM, dispatch: Dispatch, num_experts: int, expert_bytes: int,
                   owned: int):
  """(bytes on the ragged path, the same replicas plain) of one SparseAllGather, per device
  (the mean over devices of what each receives), as this device's share of it (/ N: the step
  sums the shares). `owned` > 0: add the agreement all_gather of the coding (once per layer
  and step, however many gathers)."""
  n = dispatch.num_devices
  filled = jnp.sum(plan.replica_expert_NxM < num_experts).astype(jnp.float32)
  plain = filled * expert_bytes
  codec = dispatch.replica_codec
  if choice_NxM is None:
    return plain / n ** 2, plain / n ** 2
  sent = jnp.sum(replicas_lib.slot_bytes(plan.replica_expert_NxM, choice_NxM, num_experts,
                                         codec))
  return (sent + n * (n - 1) * codec.agree_bytes(owned)) / n ** 2, plain / n ** 2


def fssdp_experts(x_TxD, experts_TxK, weights_TxK, mat: Materialized, *, dispatch: Dispatch,
                  fn: ExpertFn = SWIGLU):
  """Runs each assignment on one holder of its expert (`mat`: this step's `materialize`).
  Returns (y_TxD fp32, assignments dropped, placement stats, the layer's next replica state
  (None without the replica codec))."""
  n, dpn = dispatch.num_devices, dispatch.devices_per_node
  owners, coding = mat.owners, mat.coding
  c = mat.weights[0].shape[0] - dispatch.replica_slots
  e = owners.owner_E.shape[0]
  expert_bytes = sum(math.prod(w.shape[1:]) * w.dtype.itemsize for w in mat.weights)
  me = lax.axis_index(dispatch.axis_names)
  counts_E = router_lib.expert_counts(experts_TxK, e)
  source_load_NxE = lax.all_gather(counts_E, dispatch.axis_names, axis=0, tiled=False)

  def run(plan, weights, late_bytes):
    send_ExN = kept_for_backward("fssdp_send", lambda: planner.balanced_send(
        plan.holders_ExN, source_load_NxE, devices_per_node=dpn,
        max_shared=dispatch.overlap_degree or None)[me])
    dest_TxK = planner.dispatch_devices(experts_TxK, me, plan, devices_per_node=dpn,
                                        send_ExN=send_ExN)
    expert_A, dest_A = experts_TxK.reshape(-1), dest_TxK.reshape(-1)
    safe_e = jnp.minimum(expert_A, e - 1)
    owned_A = dest_A == owners.owner_E[safe_e]
    replica_A = plan.replica_slot_ExN[safe_e, jnp.minimum(dest_A, n - 1)]
    local_id_A = jnp.where(owned_A, owners.rank_E[safe_e], c + jnp.maximum(replica_A, 0))
    y_TxD, dropped, received, needed = exchange(
        x_TxD, dest_A, local_id_A, weights_TxK, weights, dispatch=dispatch,
        num_groups=c + dispatch.replica_slots, fn=fn)
    stats = placement_stats(received, needed, dest_A, dispatch, x_TxD.shape[-1],
                            x_TxD.dtype.itemsize)
    stats["replicas"] = plan.num_replicas.astype(jnp.float32) / n
    sent, plain = _replica_bytes(mat.plan, mat.choice_NxM, dispatch, e, expert_bytes, c)
    stats["replica_bytes"] = sent + late_bytes[0]
    stats["replica_bytes_plain"] = plain + late_bytes[1]
    held = (plan.replica_expert_NxM,
            None if coding is None else replicas_lib.to_bits(
                tuple(w[c:] for w in weights), dispatch.replica_codec.layout))
    return y_TxD, dropped, stats, held

  def finish(out):
    y_TxD, dropped, stats, (held_NxM, cache_MxR) = out
    if coding is None:
      return y_TxD, dropped, stats, {"held": held_NxM}
    return y_TxD, dropped, stats, {"held": held_NxM, "cache": cache_MxR,
                                   "prev": coding.bits_CxR, "valid": jnp.ones((), bool)}

  zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
  if not dispatch.calibrate:
    return finish(run(mat.plan, mat.weights, zero))
  # Re-plan with the actual loads; adopted only when it pays. Every device computes the same
  # decision from the same gathered counts. Not adopted, `fresh` is the first plan (its loads
  # updated to the actual ones), so every replica is kept and the late SparseAllGather moves
  # nothing on the ragged path. It runs unconditionally, in the same computation as the
  # exchange and expert compute it can overlap: no conditional around a collective, whose
  # differentiation would also carry both branches' residuals (on XLA:CPU the conditional cost
  # the tiny fssdp step 15 ms of 123). It is coded against the same state as the first gather:
  # both replace last step's replicas.
  fresh, _ = kept_for_backward("fssdp_re_plan", lambda: planner.calibrate(
      mat.plan, jnp.sum(source_load_NxE, axis=0), owners.owner_E, num_devices=n,
      devices_per_node=dpn, replica_slots=dispatch.replica_slots,
      overlap_degree=dispatch.overlap_degree, actual_source_load_NxE=source_load_NxE,
      owner_sends=dispatch.owner_sends,
      # a replica the first plan placed moves nothing
      prefer_ExN=mat.plan.holders_ExN))
  owned, first = tuple(w[:c] for w in mat.weights), tuple(w[c:] for w in mat.weights)
  reps, need_NxM, choice_NxM = late_replicas(
      owned, first, mat.plan.replica_expert_NxM, fresh.replica_expert_NxM, dispatch=dispatch,
      owners=owners, coding=coding)
  late = _replica_bytes(fresh._replace(replica_expert_NxM=need_NxM), choice_NxM, dispatch, e,
                        expert_bytes, 0)
  return finish(run(fresh, tuple(jnp.concatenate([w, r], axis=0) for w, r in zip(owned, reps)),
                    late))


def ep_stats(experts_TxK, received, needed, dispatch: Dispatch, d_model: int, num_local: int,
             itemsize: int = 2):
  expert_A = experts_TxK.reshape(-1)
  n = dispatch.num_devices
  dest_A = jnp.where(expert_A < num_local * n, expert_A // num_local, n)
  stats = placement_stats(received, needed, dest_A, dispatch, d_model, itemsize)
  stats["replicas"] = jnp.zeros((), jnp.float32)
  return stats


def placement_stats(received, needed, dest_A, dispatch: Dispatch, d_model: int,
                    itemsize: int = 2):
  """This device's share of the token bytes sent to other devices of the node and to other
  nodes (there and back), and the terms `finish_placement` makes the rest of from: the expert
  rows received here and what the buffers needed here (`exchange`'s `received`, `needed`: a
  `dispatch.Needed`)."""
  n, dpn = dispatch.num_devices, dispatch.devices_per_node
  me = lax.axis_index(dispatch.axis_names)
  valid_A = dest_A < n
  same_node_A = (dest_A // dpn) == (me // dpn)
  row_bytes = 2.0 * d_model * itemsize
  intra = jnp.sum(valid_A & same_node_A & (dest_A != me)) * row_bytes
  inter = jnp.sum(valid_A & ~same_node_A) * row_bytes
  return {"rows_received": received.astype(jnp.int32),
          "rows_needed": needed.dispatch.astype(jnp.int32),
          "receive_rows_needed": needed.receive.astype(jnp.int32),
          "token_bytes_intra_node": intra.astype(jnp.float32),
          "token_bytes_inter_node": inter.astype(jnp.float32)}


def finish_placement(stats: dict, dispatch: Dispatch) -> dict:
  """`placement_stats`' terms (stacked over any leading axes: a scan's layers, one collective
  each for all of them) -> this device's share of the straggler factor (max over devices of
  expert rows processed / their mean) and of the dispatch rows needed at one destination (the
  max over devices; the buffers hold `dispatch_capacity` of them) and of the rows one device
  received for its experts (the max over devices; `receive_capacity` runs)."""
  stats = dict(stats)
  n = dispatch.num_devices
  # (no gradient: counts, out of a differentiated step)
  rows_N = lax.all_gather(lax.stop_gradient(stats.pop("rows_received")), dispatch.axis_names,
                          axis=0, tiled=False).astype(jnp.float32)
  needed = lax.pmax(lax.stop_gradient(jnp.stack([stats.pop("rows_needed"),
                                                  stats.pop("receive_rows_needed")])),
                    dispatch.axis_names).astype(jnp.float32)
  return {"straggler": jnp.max(rows_N, axis=0) / jnp.maximum(jnp.mean(rows_N, axis=0), 1.0) / n,
          "dispatch_needed": needed[0] / n, "receive_needed": needed[1] / n, **stats}
