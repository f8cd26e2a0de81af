"""FSSDP trace replay: expert parallel (owner only) vs FSSDP replicas vs a perfectly balanced
reference, on 8 devices as 2 nodes x 4.

  python bench/fssdp.py --quick          # replay + step time; about 1.5 minutes on 2 CPU cores
  python bench/fssdp.py --record         # re-record bench/traces/tiny_recorded.npz (tiny preset)

A trace is the routing of a global batch per step and layer, kept as per-source-device expert
counts [steps, L, N, E]. Each step is replayed through:
  ep             the owner of each expert processes all its assignments (even placement).
  fssdp          `planner.materialize_plan` on the load predicted from the previous steps
                 (`LoadHistory`, sliding-window mean), preferring the devices that held an
                 expert's replicas last step as the train step does, tokens sent by the even
                 rule of `dispatch_devices` (local, else my node's holders, else all holders,
                 evenly).
  fssdp+bal      the same replicas, tokens sent by `balanced_send` (water-filled over the
                 holders from the step's actual counts; no replica changes after gating).
  fssdp+cal      then `calibrate` with the step's actual loads after gating (re-plans, preferring
                 the first plan's holders, when that pays; the new replicas are fetched late),
                 even rule.
  fssdp+cal+bal  calibrated replicas and balanced sends.
  het-ep         owner only, on heterogeneous sharding (`ownership.heterogeneous_placement`
                 of the predicted loads, re-sharded every `--reshard_every` steps).
  het+cal+bal    fssdp+cal+bal on that heterogeneous sharding.
  balanced       the reference: every device processes exactly the mean.
Figures per trace, averaged over steps 1.. (step 0 has no history yet) and layers: straggler
factor (max over devices of expert assignments processed / mean; p95 and max over layer-steps),
replicas per layer, SpAG bytes per step (replicas fetched, late ones included, x one expert in
bf16), SpRS bytes per step (replicas used x one expert's fp32 gradient), token bytes of the
dispatch per step sent within a node and across nodes (one way, bf16 rows of width D; the
combine sends the same back). All summed over layers. With calibration, `kept`: the share of the
replicas whose device held the expert last step too (what the replica codec sends as patches).
Then the real train step's time, ep against fssdp (tiny preset, 8 fake CPU devices), their steps
interleaved after a warm-up, median of 10 (`--quick`) or 20. Ends with one JSON line.

Traces: synthetic skews at tiny-preset shapes (128 tokens per device, 2 layers; 8 experts top-2
and 64 experts top-8): one hot expert, a rotating hotspot (moves every 8 steps), bursts (a mild
Zipf skew with 2-3-step bursts of one very hot expert); and one recorded from the first 60 steps
of a tiny-preset training run on 8 devices (`--record`).
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.cli_args import at_least  # noqa: E402
from moejax.placement import planner as fp  # noqa: E402
from moejax.placement import ownership as fs  # noqa: E402

TRACE_DIR = os.path.join(REPO, "bench", "traces")
RECORDED = os.path.join(TRACE_DIR, "tiny_recorded.npz")
NUM_DEVICES, DEVICES_PER_NODE = 8, 4
FSSDP_SCHEMES = ("fssdp", "fssdp+bal", "fssdp+cal", "fssdp+cal+bal", "het+cal+bal")
TARGET = 1.15


# ----------------------------------------------------------------------------- traces


def sample_counts(rng, probs_SxLxE, num_devices: int, tokens: int, k: int) -> np.ndarray:
  """Per-source expert counts [S, L, N, E]: each token picks k distinct experts, sampled without
  replacement with probabilities probs (Gumbel top-k)."""
  s, l, e = probs_SxLxE.shape
  logp = np.log(probs_SxLxE.astype(np.float32))[:, :, None, None, :]
  g = rng.gumbel(size=(s, l, num_devices, tokens, e)).astype(np.float32)
  top = np.argpartition(-(logp + g), k - 1, axis=-1)[..., :k]
  counts = np.zeros((s, l, num_devices, e), np.int32)
  idx = np.indices(top.shape[:3])
  for j in range(k):
    np.add.at(counts, (idx[0][..., None], idx[1][..., None], idx[2][..., None], top[..., j]), 1)
  return counts


def synthetic_traces(steps: int, num_experts: int, k: int, *, tokens=128, layers=2, seed=0):
  """{name: counts} for the three synthetic skews at one shape."""
  rng = np.random.default_rng(seed + num_experts)
  e = num_experts
  hot_weight = 12.0 if e <= 8 else 150.0
  out = {}
  # One hot expert per layer (a different one in each layer).
  p = np.ones((steps, layers, e))
  for l in range(layers):
    p[:, l, (3 + 5 * l) % e] = hot_weight
  out["one_hot"] = p
  # A hotspot that moves to another device's expert every `period` steps.
  p = np.ones((steps, layers, e))
  period, per_device = 8, e // NUM_DEVICES
  for l in range(layers):
    hot = int(rng.integers(e))
    for s in range(steps):
      if s and s % period == 0:
        device = (hot // per_device + int(rng.integers(1, NUM_DEVICES))) % NUM_DEVICES
        hot = device * per_device + int(rng.integers(per_device))
      p[s, l, hot] = hot_weight
  out["rotating"] = p
  # Mild Zipf skew with bursts: now and then one expert turns very hot for 2-3 steps.
  p = np.ones((steps, layers, e))
  for l in range(layers):
    base = 1.0 / np.arange(1, e + 1) ** 0.6
    p[:, l] = base[rng.permutation(e)]
    s = 1
    while s < steps:
      s += int(rng.integers(3, 9))
      length, hot = int(rng.integers(2, 4)), int(rng.integers(e))
      p[s:s + length, l, hot] = hot_weight
      s += length
  out["bursts"] = p
  return {name: sample_counts(rng, q / q.sum(-1, keepdims=True), NUM_DEVICES, tokens, k)
          for name, q in out.items()}


def load_recorded(path=RECORDED):
  with np.load(path) as z:
    return z["counts"], {k: z[k].item() for k in z.files if k != "counts"}


# ----------------------------------------------------------------------------- replay


def expand(counts_E, length: int):
  """Assignments (expert ids, sorted) of one source from its counts; sum(counts) == length."""
  ends_E = jnp.cumsum(counts_E)
  return jnp.searchsorted(ends_E, jnp.arange(length), side="right").astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def make_replay(k: int, tokens: int, *, replica_slots: int, overlap_degree: int, target: float,
                margin: float, owner_sends: int):
  """jit(segment(history, owner_LxE, counts_SxLxNxE) -> (history, per-step figures))."""
  n, dpn = NUM_DEVICES, DEVICES_PER_NODE
  kw = dict(num_devices=n, devices_per_node=dpn, replica_slots=replica_slots,
            overlap_degree=overlap_degree, target_straggler=target, owner_sends=owner_sends)

  def figures(dest_LxNxTxK):
    tokens_LxN = jax.vmap(lambda d: fp.tokens_per_device(d, n))(dest_LxNxTxK)
    st_L = jax.vmap(fp.straggler_of)(tokens_LxN.astype(jnp.float32))
    tr = jax.vmap(functools.partial(fp.traffic, devices_per_node=dpn))(dest_LxNxTxK)
    return st_L, tr["intra_node"], tr["inter_node"]

  def step(carry, xs):
    history, held_LxExN = carry          # held: last step's replicas, which the plans prefer
    owner_LxE, counts_LxNxE = xs
    actual_LxE = jnp.sum(counts_LxNxE, axis=1).astype(jnp.float32)
    experts_LxNxTxK = jax.vmap(jax.vmap(lambda c: expand(c, tokens * k)))(counts_LxNxE).reshape(
        counts_LxNxE.shape[0], n, tokens, k)
    predicted_LxE = fp.predict(history)
    # Plan from the prediction (as from even sources), then re-plan from the actual per-source
    # counts preferring the first plan's holders; calibrate picks between them.
    plan = jax.vmap(lambda l, o, h: fp.materialize_plan(l, o, prefer_ExN=h, **kw))(
        predicted_LxE, owner_LxE, held_LxExN)
    fresh = jax.vmap(lambda c, o, h: fp.materialize_plan(
        None, o, source_load_NxE=c, prefer_ExN=h, **kw))(
            counts_LxNxE.astype(jnp.float32), owner_LxE, plan.holders_ExN)
    cal, adopted_L = jax.vmap(lambda p, f, l, o, c: fp.calibrate(
        p, l, o, margin=margin, actual_source_load_NxE=c, fresh=f, **kw))(
            plan, fresh, actual_LxE, owner_LxE, counts_LxNxE)
    # The predicted and the calibrated plans side by side (one compiled dispatch for both).
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), plan, cal)
    per_layer = jax.vmap(lambda x, p, c: (
        fp.global_dispatch(x, p, devices_per_node=dpn),
        fp.global_dispatch(x, p, devices_per_node=dpn,
                           send_NxExN=fp.balanced_send(p.holders_ExN, c, devices_per_node=dpn,
                                                       max_shared=overlap_degree))))
    even_2, bal_2 = jax.vmap(lambda p: per_layer(experts_LxNxTxK, p, counts_LxNxE))(both)
    ep_dest = jax.vmap(lambda x, o: fp.owner_dispatch(x, o, n))(experts_LxNxTxK, owner_LxE)
    # Replicas calibration adds after gating are fetched late, on top of the predicted ones.
    late_L = jnp.sum(cal.holders_ExN & ~plan.holders_ExN, axis=(1, 2)).astype(jnp.int32)
    out = {}
    for name, dest, p, fetched in (
        ("ep", ep_dest, None, None),
        ("pred", even_2[0], plan, plan.num_replicas),
        ("pred_bal", bal_2[0], plan, plan.num_replicas),
        ("cal", even_2[1], cal, plan.num_replicas + late_L),
        ("cal_bal", bal_2[1], cal, plan.num_replicas + late_L)):
      st, intra, inter = figures(dest)
      zero = jnp.zeros_like(st, jnp.int32)
      out[name] = {"straggler": st, "intra": intra, "inter": inter,
                   "replicas": zero if p is None else p.num_replicas,
                   "fetched": zero if fetched is None else fetched}
    out["adopted"] = adopted_L
    # Replicas this step that a device also held last step (a patch with the replica codec).
    owned_LxExN = jax.vmap(lambda o: fp.owner_holders(o, n))(owner_LxE)
    out["kept"] = jnp.sum(cal.holders_ExN & held_LxExN & ~owned_LxExN, axis=(1, 2))
    return (fp.update_history(history, actual_LxE), cal.holders_ExN & ~owned_LxExN), out

  def segment(carry, owner_LxE, counts_SxLxNxE):
    s = counts_SxLxNxE.shape[0]
    owners = jnp.broadcast_to(owner_LxE, (s,) + owner_LxE.shape)
    return jax.lax.scan(step, carry, (owners, counts_SxLxNxE))

  return jax.jit(segment)


def replay(counts, *, k: int, reshard_every: int, replica_slots: int, overlap_degree: int,
           owner_sends: int,
           window: int, target: float, margin: float, heterogeneous: bool, expert_move_bytes: int):
  """All steps of a trace, in segments of `reshard_every` steps (one compiled scan each; the
  owners are an input, so re-sharding between segments does not recompile)."""
  steps, layers, n, e = counts.shape
  tokens = int(counts[0, 0, 0].sum()) // k
  run = make_replay(k, tokens, replica_slots=replica_slots, overlap_degree=overlap_degree,
                    target=target, margin=margin, owner_sends=owner_sends)
  carry = (fp.init_history(window=window, num_layers=layers, num_experts=e),
           jnp.zeros((layers, e, n), bool))
  owner = fs.initial_placement(layers, e, n)
  outs, moves, moved_bytes = [], 0, 0
  for start in range(0, steps, reshard_every):
    if heterogeneous and start > 0:
      new = fs.heterogeneous_placement(np.asarray(fp.predict(carry[0])), n, DEVICES_PER_NODE,
                                       previous_owner_LxE=owner)
      r = fs.reshard_moves(owner, new, num_devices=n, expert_bytes=expert_move_bytes)
      moves, moved_bytes, owner = moves + r.num_moves, moved_bytes + r.bytes_moved, new
    segment = jnp.asarray(counts[start:start + reshard_every])
    carry, out = run(carry, jnp.asarray(owner), segment)
    outs.append(jax.device_get(out))
  out = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outs)
  return out, {"reshard_moves": moves, "reshard_bytes": moved_bytes}


def summarize(counts, k, args, dims):
  """Replays one trace on even and on heterogeneous sharding; per-scheme figures."""
  d_model, expert_hidden = dims
  expert_params = 3 * d_model * expert_hidden
  spag_b, sprs_b = 2 * expert_params, 4 * expert_params    # bf16 weights, fp32 gradients
  token_b = 2 * d_model
  small = counts.shape[-1] <= 8
  overlap = args.overlap_small if small else args.overlap_large
  common = dict(k=k, reshard_every=args.reshard_every,
                replica_slots=args.replica_slots_small if small else args.replica_slots_large,
                overlap_degree=overlap,
                owner_sends=overlap if args.owner_sends == -1 else args.owner_sends,
                window=args.window,
                target=args.target_straggler, margin=args.margin,
                expert_move_bytes=12 * expert_params)   # fp32 master + Adam m, v
  even, _ = replay(counts, heterogeneous=False, **common)
  het, het_cost = replay(counts, heterogeneous=True, **common)
  rows = {}
  for name, src, key in (("ep", even, "ep"), ("fssdp", even, "pred"),
                         ("fssdp+bal", even, "pred_bal"), ("fssdp+cal", even, "cal"),
                         ("fssdp+cal+bal", even, "cal_bal"), ("het-ep", het, "ep"),
                         ("het+cal+bal", het, "cal_bal")):
    r = {f: np.asarray(v)[1:] for f, v in src[key].items()}    # skip step 0 (no history)
    st = r["straggler"]
    rows[name] = {
        "straggler": float(st.mean()), "straggler_p95": float(np.quantile(st, 0.95)),
        "straggler_max": float(st.max()),
        "replicas": float(r["replicas"].mean()),
        "spag_bytes": float(r["fetched"].sum(1).mean() * spag_b),
        "sprs_bytes": float(r["replicas"].sum(1).mean() * sprs_b),
        "intra_bytes": float(r["intra"].sum(1).mean() * token_b),
        "inter_bytes": float(r["inter"].sum(1).mean() * token_b),
    }
  rows["het+cal+bal"]["reshard_bytes"] = float(het_cost["reshard_bytes"])
  rows["het+cal+bal"]["reshard_moves"] = het_cost["reshard_moves"]
  rows["fssdp+cal"]["adopted"] = float(np.asarray(even["adopted"])[1:].mean())
  for name, src in (("fssdp+cal", even), ("fssdp+cal+bal", even), ("het+cal+bal", het)):
    kept, reps = (np.asarray(x)[1:].sum() for x in (src["kept"], src["cal"]["replicas"]))
    rows[name]["kept"] = float(kept / max(reps, 1))
  rows["balanced"] = {"straggler": 1.0}
  return rows


# ----------------------------------------------------------------------------- recording


def record(path: str, steps: int):
  """Trains the tiny preset on 8 devices for `steps` steps; before each step records the
  per-source-device expert counts of every layer on that step's batch."""
  from moejax.data import DataSpec, make_data
  from moejax.models import olmoe
  from moejax.sharding.mesh import make_mesh
  from moejax.train.loop import Trainer, put_batch
  from tests.helpers import tiny_config

  cfg = tiny_config(steps=steps)
  n = NUM_DEVICES
  trainer = Trainer(cfg, mesh=make_mesh((n // DEVICES_PER_NODE, DEVICES_PER_NODE)))
  data = make_data(DataSpec(seed=cfg.seed), batch_size=cfg.batch_size, seq_len=cfg.seq_len)
  state = trainer.init_state()

  @jax.jit
  def source_counts(params, tokens_BxS):
    per_source = tokens_BxS.reshape(n, cfg.batch_size // n, cfg.seq_len)
    aux = jax.lax.map(lambda t: olmoe.forward(cfg, params, t, remat="none")[1]["load_E"],
                      per_source)      # (ragged_dot does not vmap)
    return jnp.transpose(aux, (1, 0, 2))          # [L, N, E]

  counts, losses = [], []
  for _ in range(steps):
    host = next(data.train)
    batch = put_batch(host, trainer.mesh)
    counts.append(np.asarray(source_counts(state.params, jnp.asarray(host["inputs"]))))
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  data.train.close()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  np.savez_compressed(path, counts=np.stack(counts).astype(np.int16), k=cfg.moe.top_k,
                      d_model=cfg.model.d_model, expert_hidden=cfg.moe.expert_hidden,
                      steps=steps, first_loss=losses[0], last_loss=losses[-1])
  print(f"recorded {steps} steps to {path} (loss {losses[0]:.3f} -> {losses[-1]:.3f})")


# ----------------------------------------------------------------------------- step time

def make_step_runner(placement: str) -> Callable[[], None]:
  """One tiny-preset train step on 8 fake CPU devices (2 nodes x 4), blocking."""
  from moejax.sharding.mesh import make_mesh
  from moejax.train.loop import Trainer, put_batch
  from tests.helpers import tiny_config
  cfg = tiny_config(**{"moe.placement": placement})
  trainer = Trainer(cfg, mesh=make_mesh((2, 4), jax.devices()[:8]))
  holder = {"state": trainer.init_state()}
  toks = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.seq_len + 1))
  batch = put_batch({"inputs": toks[:, :-1].astype(np.int32),
                     "targets": toks[:, 1:].astype(np.int32)}, trainer.mesh)

  def run_one():
    holder["state"], metrics = trainer.train_step(holder["state"], batch)
    jax.block_until_ready(metrics)

  return run_one


def measure_step_time(make_step: Callable[[str], Callable[[], None]], *,
                      placements=("ep", "fssdp"), warmup: int = 2, steps: int = 5) -> dict:
  """Median seconds per train step per placement, the placements' steps interleaved (one of
  each in turn, after every one's warm-up), so that drift of the machine hits them alike."""
  runners = {placement: make_step(placement) for placement in placements}
  for run_one in runners.values():
    for _ in range(warmup):
      run_one()
  times = {placement: [] for placement in placements}
  for _ in range(steps):
    for placement, run_one in runners.items():
      t0 = time.perf_counter()
      run_one()
      times[placement].append(time.perf_counter() - t0)
  return {placement: float(np.median(t)) for placement, t in times.items()}


# ----------------------------------------------------------------------------- main


def _mb(x):
  return f"{x / 1e6:.3f}"


def print_table(results):
  header = ("trace", "scheme", "straggler", "p95", "max", "vs ep", "replicas/L", "SpAG MB",
            "SpRS MB", "intra MB", "inter MB", "inter vs ep", "kept")
  widths = (14, 13, 9, 6, 6, 6, 10, 8, 8, 8, 8, 11, 5)
  print(" | ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
  print("-+-".join("-" * w for w in widths))
  for trace, rows in results.items():
    ep = rows["ep"]
    for scheme, r in rows.items():
      if scheme == "balanced":
        cells = (trace, scheme, f"{r['straggler']:.3f}", "", "",
                 f"{r['straggler'] / ep['straggler']:.2f}", "", "", "", "", "", "", "")
      else:
        cells = (trace, scheme, f"{r['straggler']:.3f}", f"{r['straggler_p95']:.2f}",
                 f"{r['straggler_max']:.2f}", f"{r['straggler'] / ep['straggler']:.2f}",
                 f"{r['replicas']:.1f}", _mb(r["spag_bytes"]), _mb(r["sprs_bytes"]),
                 _mb(r["intra_bytes"]), _mb(r["inter_bytes"]),
                 f"{r['inter_bytes'] / max(ep['inter_bytes'], 1):.2f}",
                 f"{r['kept']:.2f}" if "kept" in r else "")
      print(" | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="40 steps per trace (about a minute and a half)")
  parser.add_argument("--steps", type=at_least(1), default=None,
                      help="synthetic steps per trace (a multiple of --reshard_every is used)")
  parser.add_argument("--record", action="store_true", help=f"re-record {RECORDED} and exit")
  parser.add_argument("--record_steps", type=at_least(1), default=60,
                      help="training steps to record with --record")
  parser.add_argument("--reshard_every", type=at_least(1), default=10,
                      help="steps between heterogeneous re-shards in the replay")
  parser.add_argument("--window", type=at_least(1), default=5,
                      help="the load predictor's window (steps)")
  parser.add_argument("--target_straggler", type=float, default=1.05,
                      help="the planner's target straggler factor")
  parser.add_argument("--margin", type=float, default=0.05,
                      help="the planner's margin over the target")
  parser.add_argument("--replica_slots_small", type=int, default=2, help="M for 8 experts")
  parser.add_argument("--replica_slots_large", type=int, default=4, help="M for 64 experts")
  parser.add_argument("--overlap_small", type=int, default=4, help="t for 8 experts")
  parser.add_argument("--overlap_large", type=int, default=12, help="t for 64 experts")
  parser.add_argument("--owner_sends", type=int, default=-1,
                      help="replica slots one owner fills per layer (fssdp.owner_sends); -1: "
                           "the config's default, 0: no bound")
  parser.add_argument("--no_step", action="store_true", help="the replay only, no step timing")
  args = parser.parse_args()
  if args.record:
    record(RECORDED, args.record_steps)
    return
  steps = args.steps if args.steps is not None else (40 if args.quick else 200)
  if steps < args.reshard_every:
    parser.error(f"argument --steps: must be >= --reshard_every={args.reshard_every}, got {steps}")
  steps -= steps % args.reshard_every
  t0 = time.perf_counter()
  traces = {}
  for e, k in ((8, 2), (64, 8)):
    for name, counts in synthetic_traces(steps, e, k).items():
      traces[f"{name}/E{e}k{k}"] = (counts, k, (64, 64))
  if os.path.exists(RECORDED):
    counts, meta = load_recorded()
    usable = min(len(counts), steps if args.quick else len(counts))
    usable -= usable % args.reshard_every
    traces[f"recorded/E{counts.shape[-1]}k{meta['k']}"] = (
        counts[:usable].astype(np.int32), int(meta["k"]), (int(meta["d_model"]),
                                                           int(meta["expert_hidden"])))
  results = {name: summarize(c, k, args, dims) for name, (c, k, dims) in traces.items()}
  elapsed = time.perf_counter() - t0
  bound = {0: "no bound on", -1: "at most t"}.get(args.owner_sends, f"at most {args.owner_sends}")
  print(f"\nFSSDP trace replay: {NUM_DEVICES} devices as {NUM_DEVICES // DEVICES_PER_NODE} nodes "
        f"x {DEVICES_PER_NODE}, {steps} steps per synthetic trace, 2 layers, 128 tokens per "
        f"device; M={args.replica_slots_small}/{args.replica_slots_large} replica slots, "
        f"t={args.overlap_small}/{args.overlap_large} (8/64 experts), "
        f"{bound} replicas from one owner, window {args.window}, "
        f"reshard every {args.reshard_every}; bytes per step, all layers")
  print_table(results)
  verdict = {}
  for trace, rows in results.items():
    if rows["ep"]["straggler"] > 2:
      verdict[trace] = {s: rows[s]["straggler"] <= TARGET for s in FSSDP_SCHEMES}
  print(f"\nTarget: straggler <= {TARGET} on every trace where ep exceeds 2 "
        f"({len(verdict)} traces):")
  for s in FSSDP_SCHEMES:
    missed = [t for t, v in verdict.items() if not v[s]]
    print(f"  {s:>13}: {'met' if not missed else 'missed on ' + ', '.join(missed)}")
  for trace, rows in results.items():
    if "reshard_bytes" in rows["het+cal+bal"]:
      h = rows["het+cal+bal"]
      print(f"  {trace}: het re-sharding moved {h['reshard_moves']} experts "
            f"({_mb(h['reshard_bytes'])} MB with optimizer state); calibration adopted in "
            f"{100 * rows['fssdp+cal']['adopted']:.0f}% of layer-steps")
  step_times = {}
  if not args.no_step:
    print("timing the train step, ep and fssdp interleaved ...", flush=True)
    step_times = measure_step_time(make_step_runner, steps=10 if args.quick else 20)
    ratio = step_times["fssdp"] / step_times["ep"]
    print(f"\nmeasured train step on 8 fake CPU devices (tiny preset, median): ep "
          f"{1000 * step_times['ep']:.1f} ms, fssdp {1000 * step_times['fssdp']:.1f} ms "
          f"(fssdp/ep {ratio:.2f}x; on CPU the planner's and SpAG's cost show, the straggler "
          f"gain does not, since fake devices share the same cores); replay took {elapsed:.1f} s")
  figures = {"steps": steps, "owner_sends": args.owner_sends, "step_time_s": step_times,
             "replay_s": elapsed,
             "target_met": {s: all(v[s] for v in verdict.values()) for s in FSSDP_SCHEMES}}
  for trace, rows in results.items():
    for scheme, r in rows.items():
      for key, v in r.items():
        figures[f"{trace}/{scheme}/{key}"] = v
  print(json.dumps(figures))


if __name__ == "__main__":
  main()
