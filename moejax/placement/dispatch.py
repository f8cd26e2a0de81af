"""Token dispatch: send each token-expert assignment to where its expert's weights are, run the
experts, bring the results back. Static shapes throughout.

Letters: T tokens here, K experts per token, A = T*K assignments, D width, E experts in all,
El experts held per device, N devices, C per-destination buffer capacity (tokens).

Dropped assignments carry the sentinel expert id E and produce zeros.

  local   every expert's weights are here (single device, or FSDP after the gather).
  ep      experts partitioned over the N devices; a static per-destination buffer of C rows
          (`send_blocks`: `all_to_all` of the whole buffer on XLA:CPU, which has no
          `ragged_all_to_all`; `lax.ragged_all_to_all` of the filled rows on GPU/TPU, chosen by
          `lax.platform_dependent`; both return the same buffer). On GPU/TPU meshes the buffers
          are packed instead (`Dispatch.packed`, `_packed_pieces`: the A rows sent, the rows
          the experts run received, the same results bit for bit; a choice of shapes, so made
          from the mesh's platform when the step is built). With `Dispatch.chunks` > 1
          the buffer goes in that many pieces of ceil(C / chunks) rows per destination, a
          destination's rows dealt to them in turn, each piece out, through the experts and
          back on its own (the same dispatch drops; each piece's experts run ceil(R / chunks)
          of its rows, `receive_capacity`; the pieces' exchanges can overlap the other pieces'
          expert matmuls).
  fssdp   as ep, plus this step's replicas of hot experts (moejax.placement.planner); each
          assignment goes to one device holding its expert (`exchange` with a destination and
          the expert's index there).

Buffers: dropless when C = A (the worst case, every assignment to one device: N x T x K rows
per device, only when asked for with a capacity factor of 0); with a capacity factor c,
C = ceil(c * A / N). What does not fit is dropped and counted; each exchange also reports the
most rows any device sent to one destination (`needed`), so a caller can size C from measured
loads. The train step under `OVERFLOW_POLICIES` "grow" (the default) applies no update when
anything was dropped and the Trainer reruns it with a larger C (`grown_capacity_factor`): the
step stays lossless with bounded buffers.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moejax.placement.experts import SWIGLU, ExpertFn, run_sorted
from moejax.sharding.prefetch import recomputes


KINDS = ("local", "ep", "fssdp")


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """How the MoE block reaches its experts (static)."""
  kind: str = "local"                 # "local" | "ep" | "fssdp"
  axis_names: tuple = ()
  num_devices: int = 1
  devices_per_node: int = 1
  capacity_factor: float = 0.0        # ep / fssdp; 0 = dropless
  replica_slots: int = 0              # fssdp: M replica slots per device per layer
  overlap_degree: int = 0             # fssdp: t, distinct experts materialized per step
  owner_sends: int = 0                # fssdp: replica slots one owner fills per step; 0 = N * M
  calibrate: bool = False             # fssdp: re-plan after gating when it pays
  replica_codec: Any = None           # fssdp: `codec.replicas.ReplicaCodec`, None = plain
  chunks: int = 1                     # ep / fssdp: the exchange in this many independent pieces
  receive_capacity_factor: float = 0.0  # ep / fssdp: rows run through the experts here, of
                                        # the receive buffer; 0 = all (`receive_capacity`)
  packed: bool = False                # ep / fssdp: packed exchange buffers (`ragged_all_to_all`,
                                      # GPU/TPU); else per-destination blocks (any platform)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Dispatch.kind={self.kind!r}: must be one of {', '.join(KINDS)}")
    if self.kind != "local" and not self.axis_names:
      raise ValueError(f"Dispatch.kind={self.kind!r} needs axis_names: the mesh axes its "
                       "devices span, which it exchanges over")


LOCAL = Dispatch()

# moe.dispatch_overflow: what a step whose dispatch buffers overflow does.
#   grow  the step applies no update; the Trainer grows the buffers from the measured loads and
#         reruns it (lossless)
#   drop  the overflowing assignments are dropped and counted (ep_dropped_frac), as GShard does
OVERFLOW_POLICIES = ("grow", "drop")
# moe.exchange_buffers: the exchange's buffers.
#   blocks  N x C rows each way, each destination's block whole (`_block_pieces`; XLA:CPU moves
#           them whole, GPU/TPU the filled rows)
#   packed  the rows sent, and the rows the experts run received (`_packed_pieces`;
#           `ragged_all_to_all` only: GPU/TPU)
#   auto    packed where the devices are not CPUs
EXCHANGE_BUFFERS = ("auto", "blocks", "packed")
# Growth: at least this factor over the old capacity (every growth compiles the step again, so
# few of them), and this margin over the rows the overflowing step needed.
GROWTH, MARGIN = 2.0, 1.25


def max_rows(tokens: int, top_k: int, experts_held: int) -> int:
  """The most rows one destination can be sent: a token sends one row per expert it routes to,
  so at most min(K, the experts that device holds for the layer) of its K go to one device."""
  return tokens * (min(top_k, experts_held) if experts_held > 0 else top_k)


def ep_capacity(num_assignments: int, num_devices: int, capacity_factor: float,
                most: int | None = None) -> int:
  """C: rows per destination of the dispatch buffer, at most `most` (`max_rows`; A when not
  given): the dropless buffer when the factor is 0."""
  whole = num_assignments if most is None else min(num_assignments, most)
  if capacity_factor <= 0:
    return whole
  return min(whole, max(1, math.ceil(capacity_factor * num_assignments / num_devices)))


def receive_capacity(num_assignments: int, num_devices: int, capacity_factor: float,
                     receive_factor: float, pieces: int = 1, packed: bool = False,
                     most: int | None = None) -> int:
  """R: the rows of one piece's receive buffer (N x ceil(C / pieces) rows) a device runs through
  its experts: ceil(receive_factor * A / pieces), at most the buffer; the whole buffer when the
  factor is 0, on one device, or with dropless blocks (C = A; packed buffers hold R rows, so
  there R bounds what a dropless exchange receives).

  Why: the receive buffer holds room for what every source may send (C rows from each of N),
  about capacity_factor x A rows, while a device receives about A when the load is balanced
  (fssdp's plan balances it); on GPU the grouped matmuls run over every row they are given
  (jax's Hopper kernel computes each row tile whether or not it holds rows; XLA's `ragged_dot`
  is a dense product), so a buffer of 2 A costs twice the routed work. The filled rows come
  first once sorted by expert, so only the first R go through the experts; a device that
  received more overflows, as a full dispatch buffer does."""
  c = ep_capacity(num_assignments, num_devices, capacity_factor, most)
  whole = num_devices * -(-c // pieces)
  dropless = c >= (num_assignments if most is None else min(num_assignments, most))
  if receive_factor <= 0 or num_devices <= 1 or (dropless and not packed):
    return whole
  return min(whole, max(1, math.ceil(receive_factor * num_assignments / pieces)))


def _grown(old_rows: int, needed_rows: int, num_assignments: int,
           num_devices: int = 1) -> tuple[int, float]:
  """(rows, factor) of a grown buffer of factor x A / N rows: room for MARGIN times the need, at
  least GROWTH times the old rows (every growth compiles the step again); the smallest factor
  giving at least those rows (the sizes round up), in a short decimal."""
  rows = max(math.ceil(MARGIN * needed_rows), math.ceil(GROWTH * old_rows), old_rows + 1)
  return rows, float(math.ceil(rows * num_devices / num_assignments * 1000) / 1000)


def grown_receive_factor(receive_factor: float, needed_rows: int, num_assignments: int) -> float:
  """The receive capacity factor after a step in which a device received `needed_rows` rows
  (over all pieces) for its experts (`_grown`)."""
  return _grown(math.ceil(receive_factor * num_assignments), needed_rows, num_assignments)[1]


def grown_capacity_factor(capacity_factor: float, needed_rows: int, num_assignments: int,
                          num_devices: int, most: int | None = None) -> float:
  """The capacity factor after a step needed `needed_rows` rows at one destination (`_grown`);
  0 (dropless) once that reaches the most a destination can be sent (`max_rows`; A when not
  given)."""
  rows, factor = _grown(ep_capacity(num_assignments, num_devices, capacity_factor, most),
                        needed_rows, num_assignments, num_devices)
  return 0.0 if rows >= (num_assignments if most is None else min(num_assignments, most)) else (
      factor)


def combine(y_AxD, weights_TxK):
  t, k = weights_TxK.shape
  y_TxKxD = y_AxD.reshape(t, k, -1).astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK.astype(jnp.float32))


def local_experts(x_TxD, experts_TxK, weights_TxK, *ws, fn: ExpertFn = SWIGLU):
  """All experts held here (`ws`: the expert arrays of `fn`, `moejax.placement.experts`).
  Returns (y_TxD fp32, overflow count 0)."""
  t, k = experts_TxK.shape
  x_AxD = jnp.repeat(x_TxD, k, axis=0)
  y_AxD = run_sorted(x_AxD, experts_TxK.reshape(-1), ws[0].shape[0], *ws, fn=fn)
  return combine(y_AxD, weights_TxK), jnp.zeros((), jnp.int32)


def exchange(x_TxD, dest_A, local_id_A, weights_TxK, ws, *, dispatch: Dispatch,
             num_groups: int, fn: ExpertFn = SWIGLU):
  """Sends assignment a (token a // K) to device dest_A[a] (N = nowhere), where it runs through
  local expert group local_id_A[a] of the receiver's `num_groups` weight groups, and brings the
  result back. Returns (y_TxD fp32, assignments dropped for lack of buffer room here (a full
  dispatch buffer's at the sender, rows received past `receive_capacity` here), rows received
  here, `Needed` here; their max over the devices is what the buffers needed, taken after the
  layers, `fssdp.finish_placement`: no collective for telemetry in the layer). A token's K
  assignments name distinct experts (top-k does, and admission's reroute keeps them distinct):
  a destination is then sent at most T x min(K, num_groups) rows, the dropless buffer
  (`max_rows`); repeated experts in one token's row could overflow it."""
  t, k = weights_TxK.shape
  n, a, d = dispatch.num_devices, t * k, x_TxD.shape[-1]
  size = math.prod(lax.axis_size(name) for name in dispatch.axis_names)
  if size != n:    # a destination past the axis would be dropped without a count
    raise ValueError(f"Dispatch.num_devices={n}, but its axes {dispatch.axis_names} hold {size} "
                     "devices: set num_devices to their size")
  most = max_rows(t, k, num_groups)         # a dropless buffer needs no more
  c = ep_capacity(a, n, dispatch.capacity_factor, most)
  # In `dispatch.chunks` pieces, each out, through the experts and back on its own: nothing ties
  # one piece's exchange to another's experts, so a scheduler can run piece j + 1's exchange
  # under piece j's expert matmuls. A destination's row `pos` goes to piece pos % pieces, at row
  # pos // pieces there, so each piece carries its share of what is sent whatever the fill (a
  # split by position would leave the later pieces empty: buffers are sized above the mean).
  # The same rows fit (pos < c), so the same drops.
  pieces = dispatch.chunks
  rows = -(-c // pieces)                 # rows per piece and destination
  valid_A = dest_A < n
  onehot_AxN = jax.nn.one_hot(dest_A, n, dtype=jnp.int32)
  pos_A = jnp.sum((jnp.cumsum(onehot_AxN, axis=0) - onehot_AxN) * onehot_AxN, axis=1)
  fits_A = valid_A & (pos_A < c)
  x_AxD = jnp.repeat(x_TxD, k, axis=0)
  sent_N = jnp.sum(onehot_AxN * fits_A[:, None].astype(jnp.int32), axis=0)   # rows to each
  # The rows each piece runs through the experts here (`receive_capacity`); rows received past
  # them come back as zeros and count as dropped here (a step under "grow" then reruns).
  computed = receive_capacity(a, n, dispatch.capacity_factor, dispatch.receive_capacity_factor,
                              pieces, dispatch.packed, most)
  pieces_of = _packed_pieces if dispatch.packed else _block_pieces
  y_back, slot_A, got = pieces_of(x_AxD, dest_A, pos_A, fits_A, local_id_A,
                                  piece_counts(sent_N, pieces), ws, dispatch=dispatch,
                                  num_groups=num_groups, fn=fn, rows=rows, computed=computed)
  y_AxD = jnp.where(fits_A[:, None], y_back[jnp.minimum(slot_A, y_back.shape[0] - 1)], 0)
  received = sum(got)
  peak = functools.reduce(jnp.maximum, got)
  past = sum(jnp.maximum(g - computed, 0) for g in got)
  dropped = jnp.sum(valid_A & ~fits_A).astype(jnp.int32) + past
  needed = Needed(jnp.max(jnp.sum(onehot_AxN, axis=0)).astype(jnp.int32), peak * pieces)
  return combine(y_AxD, weights_TxK), dropped, received, needed


def _block_pieces(x_AxD, dest_A, pos_A, fits_A, local_id_A, counts, ws, *, dispatch: Dispatch,
                  num_groups: int, fn: ExpertFn, rows: int, computed: int):
  """`exchange`'s pieces through per-destination blocks: a destination's block of the send buffer
  is pieces x rows; each piece's receive buffer is N blocks of `rows`, the first `computed` rows
  in expert order run. Returns (results [N x pieces x rows, D] where the rows were sent, each
  assignment's row there (the buffer's length where it was not sent), rows each piece received
  here)."""
  n, d, pieces = dispatch.num_devices, x_AxD.shape[-1], len(counts)
  block = pieces * rows                  # >= c: at most pieces - 1 rows more
  slot_A = jnp.where(fits_A, dest_A * block + (pos_A % pieces) * rows + pos_A // pieces,
                     n * block)                                   # n * block: a discard row
  send_x, send_g = _send_buffers(x_AxD, local_id_A, slot_A, n * block, num_groups)
  send_x_NxBxD, send_g_NxB = send_x.reshape(n, block, d), send_g.reshape(n, block)
  blocks = dict(axes=dispatch.axis_names, num_devices=n, capacity=rows)
  y_back, got = [], []
  for j, piece_N in enumerate(counts):
    lo, hi = j * rows, (j + 1) * rows
    recv_g, received_N = _send_groups(send_g_NxB[:, lo:hi].reshape(-1), piece_N, num_groups,
                                      **blocks)
    recv_x = send_blocks(send_x_NxBxD[:, lo:hi].reshape(-1, d), piece_N, received_N, 0,
                         **blocks)
    y_recv = run_sorted(recv_x, recv_g, num_groups, *ws, packed=False,   # zeros where no group
                        fn=fn, rows=computed)
    y_back.append(send_blocks(y_recv, received_N, piece_N, 0, **blocks).reshape(n, rows, d))
    got.append(jnp.sum(received_N).astype(jnp.int32))
  y_back = (jnp.concatenate(y_back, axis=1) if pieces > 1 else y_back[0]).reshape(n * block, d)
  return y_back, slot_A, got


def _packed_pieces(x_AxD, dest_A, pos_A, fits_A, local_id_A, counts, ws, *, dispatch: Dispatch,
                   num_groups: int, fn: ExpertFn, rows: int, computed: int):
  """`exchange`'s pieces through packed buffers (`Dispatch.packed`; `ragged_all_to_all` only, so
  GPU/TPU): piece j's rows sit in region j of the send buffer, destinations in order, each
  region S = min(A, (A + N (pieces - 1)) // pieces) rows (piece j holds ceil((sent - j) /
  pieces) of a destination's rows); a piece's receive buffer is its `computed` rows (R), which
  take the sources' rows in source order while they fit. Every device computes every route
  from one all_gather of the counts. Against `_block_pieces`: A rows sent instead of N x C =
  capacity factor x A, R received instead of N x C; the rows a receiver takes, in expert order,
  are the ones the blocks would run, so the results and gradients are the same bits (a piece
  that overflows R drops other rows: the step under "grow" reruns). Returns as
  `_block_pieces`."""
  n, a, pieces = dispatch.num_devices, x_AxD.shape[0], len(counts)
  axes = dispatch.axis_names
  span = packed_span(a, n, pieces)
  me = lax.axis_index(axes)
  count_SxPxN = lax.all_gather(jnp.stack(counts).astype(jnp.int32), axes, axis=0, tiled=False)
  send_off_SxPxN = jnp.cumsum(count_SxPxN, axis=2) - count_SxPxN      # in the source's region
  before_SxPxN = jnp.cumsum(count_SxPxN, axis=0) - count_SxPxN        # earlier sources' rows
  taken_SxPxN = jnp.clip(computed - before_SxPxN, 0, count_SxPxN)     # what fits in R
  recv_off_SxPxN = jnp.cumsum(taken_SxPxN, axis=0) - taken_SxPxN      # in the receiver's R
  piece_A = pos_A % pieces
  own_off_PxN = send_off_SxPxN[me]
  slot_A = jnp.where(fits_A, piece_A * span + own_off_PxN[piece_A, jnp.minimum(dest_A, n - 1)]
                     + pos_A // pieces, pieces * span)            # pieces * span: a discard row
  send_x, send_g = _send_buffers(x_AxD, local_id_A, slot_A, pieces * span, num_groups)
  y_back, got = [], []
  for j in range(pieces):
    # (input offsets, send sizes, output offsets at each peer, receive sizes), out and back
    out = (send_off_SxPxN[me, j], taken_SxPxN[me, j], recv_off_SxPxN[me, j], taken_SxPxN[:, j, me])
    back = (recv_off_SxPxN[:, j, me], taken_SxPxN[:, j, me], send_off_SxPxN[:, j, me],
            taken_SxPxN[me, j])
    region = slice(j * span, (j + 1) * span)
    recv_g = send_rows(send_g[region], out, back, num_groups, axes=axes, rows=computed)
    recv_x = send_rows(send_x[region], out, back, 0, axes=axes, rows=computed)
    y_recv = run_sorted(recv_x, recv_g, num_groups, *ws, packed=False, fn=fn,
                        tiled_as=n * rows)    # the CPU kernel's tiles: the blocks' (emulation)
    y_back.append(send_rows(y_recv, back, out, 0, axes=axes, rows=span))
    got.append(jnp.sum(count_SxPxN[:, j, me]).astype(jnp.int32))
  y_back = jnp.concatenate(y_back) if pieces > 1 else y_back[0]
  return y_back, slot_A, got


def packed_span(num_assignments: int, num_devices: int, pieces: int) -> int:
  """S: the rows of one piece's region of a packed send buffer. Piece j holds ceil((sent - j) /
  pieces) of the rows sent to each destination, at most (A + N (pieces - 1)) / pieces in all."""
  a = num_assignments
  return min(a, (a + num_devices * (pieces - 1)) // pieces)


def _send_buffers(x_AxD, local_id_A, slot_A, rows: int, num_groups: int):
  """A send buffer of `rows` rows: assignment a at row slot_A[a] (`rows`: not sent), its local
  expert group beside it; empty rows hold zeros and group `num_groups`."""
  send_x = jnp.zeros((rows + 1, x_AxD.shape[-1]), x_AxD.dtype).at[slot_A].set(x_AxD)[:-1]
  send_g = jnp.full((rows + 1,), num_groups, jnp.int32).at[slot_A].set(local_id_A)[:-1]
  return send_x, send_g


def send_rows(x_RxD, route, back, fill, *, axes, rows: int):
  """`lax.ragged_all_to_all` of `x_RxD`'s rows along `route` (input offsets, send sizes, output
  offsets at each peer, receive sizes: [N] each) into a buffer of `rows` rows holding `fill`
  where nothing lands; the transpose moves the cotangent's rows back along `back` (the same
  rows, the other way). Written out, not left to jax's transpose rule, which exchanges the
  offsets again: here every device already knows every route (`_packed_pieces`)."""
  return _send_rows(x_RxD, tuple(route), tuple(back), fill, axes, rows, x_RxD.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _send_rows(x_RxD, route, back, fill, axes, rows: int, rows_in: int):
  del back, rows_in
  output = jnp.full((rows,) + x_RxD.shape[1:], fill, x_RxD.dtype)
  return lax.ragged_all_to_all(x_RxD, output, *(r.astype(jnp.int32) for r in route),
                               axis_name=axes)


def _send_rows_fwd(x_RxD, route, back, fill, axes, rows, rows_in):
  return _send_rows(x_RxD, route, back, fill, axes, rows, rows_in), (route, back)


def _send_rows_bwd(fill, axes, rows, rows_in, routes, g):
  route, back = routes
  none = tuple(None for _ in route)
  return _send_rows(g, back, route, 0, axes, rows_in, rows), none, none


_send_rows.defvjp(_send_rows_fwd, _send_rows_bwd)


class Needed(NamedTuple):
  """What an exchange's buffers needed here: `dispatch`, the most rows this device sent to one
  destination (C holds `dispatch_capacity_factor`'s); `receive`, the pieces times the most rows
  one piece brought here (R holds `receive_capacity`'s per piece). Their maxima over the
  devices size grown buffers (`grown_capacity_factor`, `grown_receive_factor`)."""
  dispatch: jax.Array
  receive: jax.Array


def piece_counts(sent_N, pieces: int) -> list:
  """Rows each piece sends to each destination, of `sent_N` rows sent there in all: piece j
  holds rows pos = j, j + pieces, ... (`exchange`), ceil((sent - j) / pieces) of them."""
  return [jnp.maximum(sent_N - j + pieces - 1, 0) // pieces for j in range(pieces)]


def _send_groups(send_g, sent_N, num_groups: int, *, axes, num_devices: int, capacity: int):
  """`send_blocks` of the rows' group ids (`num_groups` where empty), and the rows each device
  sent here: read off the ids on CPU, where every row travels; on GPU/TPU the ragged exchange
  needs them first (one all_to_all of N counts)."""
  n, c = num_devices, capacity

  def static(send_g, sent_N):
    recv_g = send_blocks(send_g, sent_N, sent_N, num_groups, axes=axes, num_devices=n,
                         capacity=c, platform="cpu")
    return recv_g, jnp.sum(recv_g.reshape(n, c) < num_groups, axis=1, dtype=jnp.int32)

  def ragged(send_g, sent_N):
    received_N = lax.all_to_all(sent_N, axes, 0, 0, tiled=True)
    return send_blocks(send_g, sent_N, received_N, num_groups, axes=axes, num_devices=n,
                       capacity=c, platform="gpu"), received_N

  return lax.platform_dependent(send_g, sent_N, cpu=static, default=ragged)


def send_blocks(x_NCxR, send_N, recv_N, fill, *, axes, num_devices: int, capacity: int,
                platform: str = ""):
  """Block d of `x_NCxR` ([N * C, ...], rows d*C .. d*C + send_N[d] - 1 filled, the rest hold
  `fill`) goes to device d, where it lands in block `me`; returns the blocks received here
  (block s: the `recv_N[s]` rows device s sent here, then `fill`).

  XLA:CPU has no `ragged_all_to_all`: there the whole static buffer moves (`all_to_all`). On
  GPU/TPU `lax.ragged_all_to_all` moves only the filled rows into a buffer of the same fill, so
  both return the same array. `platform` "cpu" or "gpu" takes that branch without asking.
  The transpose is the same exchange with the counts swapped (unfilled rows get no gradient on
  GPU), chosen afresh where it is traced: left to autodiff, the platform index would become a
  residual, and inside a conditional's transposed branch the choice would stay a conditional of
  its own around the collective."""
  return _send_blocks(x_NCxR, send_N, recv_N, fill, axes, num_devices, capacity, platform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _send_blocks(x_NCxR, send_N, recv_N, fill, axes, n: int, c: int, platform: str):
  def static(x, send_N, recv_N):
    del send_N, recv_N   # the unfilled rows travel too: they already hold the fill
    return lax.all_to_all(x.reshape((n, c) + x.shape[1:]), axes, 0, 0,
                          tiled=True).reshape(x.shape)

  def ragged(x, send_N, recv_N):
    me = lax.axis_index(axes)
    starts_N = jnp.arange(n, dtype=jnp.int32) * c
    return lax.ragged_all_to_all(x, jnp.full_like(x, fill), starts_N, send_N.astype(jnp.int32),
                                 jnp.full((n,), me * c, jnp.int32), recv_N.astype(jnp.int32),
                                 axis_name=axes)

  if platform:
    return (static if platform == "cpu" else ragged)(x_NCxR, send_N, recv_N)
  return lax.platform_dependent(x_NCxR, send_N, recv_N, cpu=static, default=ragged)


def _send_blocks_fwd(x_NCxR, send_N, recv_N, fill, axes, n, c, platform):
  return _send_blocks(x_NCxR, send_N, recv_N, fill, axes, n, c, platform), (send_N, recv_N)


def _send_blocks_bwd(fill, axes, n, c, platform, counts, g_NCxR):
  send_N, recv_N = counts
  return _send_blocks(g_NCxR, recv_N, send_N, 0, axes, n, c, platform), None, None


_send_blocks.defvjp(_send_blocks_fwd, _send_blocks_bwd)


def ep_experts(x_TxD, experts_TxK, weights_TxK, *ws, dispatch: Dispatch,
               fn: ExpertFn = SWIGLU):
  """Expert parallel: experts [El, ...] here (device d owns experts d*El .. d*El+El-1).
  Returns `exchange`'s (y_TxD fp32, dropped here, received here, `Needed`)."""
  n = dispatch.num_devices
  el = ws[0].shape[0]
  expert_A = experts_TxK.reshape(-1)
  dest_A = jnp.where(expert_A < el * n, expert_A // el, n)
  return exchange(x_TxD, dest_A, expert_A % el, weights_TxK, ws, dispatch=dispatch,
                  num_groups=el, fn=fn)


def ep_a2a_bytes(tokens_per_device: int, top_k: int, d_model: int, num_devices: int,
                 capacity_factor: float, *, remat: str, itemsize: int = 2,
                 packed: bool = False, most: int | None = None) -> float:
  """Bytes per device per MoE layer per step moved by the ep all_to_alls (buffer capacity:
  N x C rows, C at most `most` (`max_rows`); `packed`, the T x K rows a packed send buffer
  holds, at most C a destination).

  Forward sends tokens out and results back (2 exchanges, plus 4-byte expert ids); backward
  does the same for the cotangents (2); a recomputing remat (full, minimal: an all_to_all is no
  matmul) repeats the forward (2).
  """
  n = num_devices
  c = ep_capacity(tokens_per_device * top_k, n, capacity_factor, most)
  rows = min(n * c, tokens_per_device * top_k) if packed else n * c
  frac = (n - 1) / n
  one = frac * rows * d_model * itemsize
  ids = frac * rows * 4
  forward = 2 * one + ids
  return forward * (2 if recomputes(remat) else 1) + 2 * one
