"""Step time: moejax's train step beside a plain-JAX floor (bench/reference.py), interleaved in one
process so the machine's drift hits every variant alike.

  python bench/step.py --quick        # peer dims: reference, 1 device, reference x8, fsdp x8
  python bench/step.py                # tiny and peer dims x {1 device; on 8 fake devices the
                                      #   reference, fsdp, ep, fssdp, fssdp with coded replicas,
                                      #   codec element / delta forced}
  python bench/step.py --experts      # tiny, top-2, 1 device: E = 8, 32, 128 (fixed routed work),
                                      #   and the reference at E = 8 and 128
  python bench/step.py --scaling      # peer dims, ep and fssdp on 2, 4 and 8 fake devices (the
                                      #   same global batch): what sharing the cores costs each
  python bench/step.py --tiles        # the CPU expert kernel alone, fwd+bwd CPU ms per call, at
                                      #   each tile size M, for the shapes the variants run
  python bench/step.py --only codec --only "tiny fsdp"   # a subset, by name
  python bench/step.py --quick --peer # then ../shared/peers/maxtext/compare.sh (MaxText beside)
  python bench/step.py --profile --only "peer codec delta"   # where each chosen variant's step
                                      #   spends its time, by moejax source line
                                      #   (moejax.profiling; no timing table)

Per variant: median s/step, tokens/s, XLA-counted GFLOP and GB accessed of the compiled step
(`cost_analysis`; loops counted once, so a scanned model's figures are per layer-iteration),
peak memory (`memory_analysis`: arguments + temporaries + outputs - aliased), and the ratio to
the reference of the same dims (to the first variant of a sweep); fsdp x8 also to `reference x8`,
the same plain-JAX step split over the same 8 devices (data parallel, ZeRO-1): the 8-device
floor, since splitting the work eight ways over these cores costs every program alike. Codec
variants also print the fraction of their gathered bytes that went compressed. Ends with one
JSON line.

The peer dims are those of ../shared/peers/maxtext/compare.sh (2 layers, d_model 256, 4 heads x
64, 8 experts top-2, expert hidden 512, seq 128, global batch 16). Variants on 8 fake CPU devices
share the same cores as the one-device ones: the same total work, so their ratio is the cost of
sharding it.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import configs.olmoe as olmoe_configs  # noqa: E402
import reference  # noqa: E402
from bench.cli_args import at_least  # noqa: E402
from moejax import host_memory, profiling  # noqa: E402
from moejax.config import from_config_dict  # noqa: E402
from moejax.models import olmoe  # noqa: E402
from moejax.sharding.mesh import make_mesh  # noqa: E402
from moejax.train.loop import Trainer, put_batch  # noqa: E402

PEER = {"model.d_model": 256, "model.num_layers": 2, "model.num_heads": 4, "model.head_dim": 64,
        "moe.num_experts": 8, "moe.top_k": 2, "moe.expert_hidden": 512, "model.vocab_size": 257,
        "seq_len": 128, "batch_size": 16}
DIMS = {"tiny": {}, "peer": PEER}
# Codec variants: the mode forced on every sharded parameter, past its warm-up, at a fine-tuning
# learning rate (most weights keep their exponents, as in bench/codec.py's low-rate phase).
CODEC = {"codec.select": False, "codec.warmup_steps": 2, "optim.lr": 1e-4}


def config(dims: str, **overrides):
  cd = olmoe_configs.get_config("tiny")
  # Dropless ep/fssdp buffers: this bench runs the compiled step itself, without the Trainer's
  # regrowth (moejax.train.loop.GrowingStep), so a bounded buffer could overflow unnoticed.
  cd.moe.dispatch_capacity_factor = 0.0
  cd.update_from_flattened_dict({**DIMS[dims], "steps": 1000, **overrides})
  return from_config_dict(cd)


@dataclasses.dataclass
class Variant:
  name: str
  dims: str
  devices: int = 1                 # 0: the plain-JAX reference (one device)
  overrides: dict = dataclasses.field(default_factory=dict)
  baseline: str = ""               # ratio to this variant ("" = the reference of its dims)
  floor: bool = False              # the plain-JAX reference on `devices` devices (data parallel)
  also: str = ""                   # a second ratio, to this variant
  times: list = dataclasses.field(default_factory=list)
  figures: dict = dataclasses.field(default_factory=dict)
  last: dict = dataclasses.field(default_factory=dict)   # a moejax variant's latest metrics

  def build(self, batches):
    """Compiles the step; returns a function running one step (blocking)."""
    cfg = config(self.dims, **self.overrides)
    self.tokens = cfg.batch_size * cfg.seq_len
    if self.devices == 0:
      step, tx = reference.make_train_step(cfg, remat=cfg.remat)
      params = olmoe.init_params(cfg, jax.random.key(cfg.seed))
      state = [params, tx.init(params)]
      # on the device before timing, as the other variants' batches
      placed = [{k: jax.device_put(v) for k, v in b.items()} for b in batches]
      compiled = step.lower(state[0], state[1], placed[0]).compile()

      def run(i):
        state[0], state[1], ce = compiled(state[0], state[1], placed[i % len(placed)])
        jax.block_until_ready(ce)
    elif self.floor:
      mesh = make_mesh((1, -1), jax.devices()[:self.devices])
      step, init = reference.make_sharded_train_step(cfg, mesh, remat=cfg.remat)
      state = list(init(olmoe.init_params(cfg, jax.random.key(cfg.seed))))
      placed = [put_batch(b, mesh) for b in batches]
      compiled = step.lower(*state, placed[0]["inputs"], placed[0]["targets"]).compile()

      def run(i):
        b = placed[i % len(placed)]
        state[0], state[1], ce = compiled(state[0], state[1], b["inputs"], b["targets"])
        jax.block_until_ready(ce)
    else:
      trainer = Trainer(cfg, mesh=make_mesh((1, -1), jax.devices()[:self.devices]))
      state = [trainer.init_state()]
      placed = [put_batch(b, trainer.mesh) for b in batches]
      compiled = trainer.train_step.lower(state[0], placed[0]).compile()

      def run(i):
        state[0], metrics = compiled(state[0], placed[i % len(placed)])
        self.last = metrics
        jax.block_until_ready(metrics)
    self.compiled = compiled
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    self.figures = {"gflop": cost.get("flops", 0.0) / 1e9,
                    "gb_accessed": cost.get("bytes accessed", 0.0) / 1e9}
    if mem is not None:
      self.figures["peak_mb"] = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                                 + mem.output_size_in_bytes - mem.alias_size_in_bytes) / 2**20
    return run

  def compressed_fraction(self):
    m = self.last
    if "codec_params" not in m or float(m["gather_bytes_plain"]) == 0:
      return None
    return 1.0 - float(m["gather_bytes"]) / float(m["gather_bytes_plain"])


def variants(args) -> list[Variant]:
  if args.experts:
    sweep = [Variant(f"tiny E={e}", "tiny", 1, {"moe.num_experts": e}, baseline="tiny E=8")
             for e in (8, 32, 128)]
    return sweep + [Variant(f"tiny reference E={e}", "tiny", 0, {"moe.num_experts": e},
                            baseline="tiny reference E=8") for e in (8, 128)]
  if args.scaling:
    # fssdp's static sparse collectives move [N, M, ...] buffers per device (the ragged ones on
    # GPU move the M filled slots), so its cost over ep grows with N on fake devices.
    return [v for n in (2, 4, 8) for v in (
        Variant(f"peer ep x{n}", "peer", n, {"moe.placement": "ep"}),
        Variant(f"peer fssdp x{n}", "peer", n, {"moe.placement": "fssdp"},
                baseline=f"peer ep x{n}"))]
  dims_list = ("peer",) if args.quick else ("tiny", "peer")
  out = []
  for dims in dims_list:
    out += [Variant(f"{dims} reference", dims, 0), Variant(f"{dims} 1 device", dims, 1)]
    out += [Variant(f"{dims} reference x8", dims, 8, floor=True),
            Variant(f"{dims} fsdp x8", dims, 8, {"moe.placement": "fsdp"},
                    also=f"{dims} reference x8")]
    if args.quick:
      continue
    out += [Variant(f"{dims} ep x8", dims, 8, {"moe.placement": "ep"}),
            Variant(f"{dims} fssdp x8", dims, 8, {"moe.placement": "fssdp"},
                    baseline=f"{dims} ep x8"),
            Variant(f"{dims} fssdp coded replicas x8", dims, 8,
                    {"moe.placement": "fssdp", "fssdp.replica_codec": "delta"},
                    baseline=f"{dims} fssdp x8")]
    for mode in ("element", "delta"):
      out.append(Variant(f"{dims} codec {mode} x8", dims, 8, {"codec.mode": mode, **CODEC},
                         baseline=f"{dims} fsdp x8"))
  return out


# (d_model, expert_hidden, rows, experts, rows routed) of the kernel calls the variants make on
# one device: rows routed < rows for an exchange buffer (dropless: its empty slots).
TILE_SHAPES = {"tiny 1 device": (64, 64, 2048, 8, 2048), "tiny fsdp x8": (64, 64, 256, 8, 256),
               "tiny E=32": (64, 64, 2048, 32, 2048), "tiny E=128": (64, 64, 2048, 128, 2048),
               "tiny ep x8": (64, 64, 2048, 1, 256), "peer 1 device": (256, 512, 4096, 8, 4096),
               "peer fsdp x8": (256, 512, 512, 8, 512), "peer ep x8": (256, 512, 4096, 1, 512)}


def tile_sweep(rounds: int):
  """CPU seconds of the expert kernel's fwd+bwd per call, the loop at each tile size M and the
  batched kernel at M=128 (process time: on 8 fake devices the cores are saturated, so CPU time
  is what a device's call costs; on one device the batched kernel's larger matmuls use both
  cores, so the train step decides there, see BATCHED_FROM)."""
  from moejax.placement import experts
  results = []
  for name, (d, f, a, g, routed) in TILE_SHAPES.items():
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.standard_normal((a, d)), jax.numpy.bfloat16)
    sizes = jax.numpy.asarray(np.bincount(rng.integers(0, g, routed), minlength=g), "int32")
    w = [jax.numpy.asarray(rng.standard_normal(sh) * 0.05, jax.numpy.bfloat16)
         for sh in ((g, d, f), (g, d, f), (g, f, d))]
    kernels = [("loop", experts._looped, m) for m in (16, 32, 64, 128, 256) if m <= 4 * a // g]
    calls = {}
    for kname, kernel, m in kernels + [("batched", experts._batched, 128)]:
      # The group sizes as an argument, as in the train step (a constant would let XLA fix the
      # loop's trip count).
      loss = lambda x, sizes, *w, k=kernel, m=m: jax.numpy.sum(   # noqa: E731
          k(x, sizes, w, m).astype("float32") ** 2)
      fn = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))
      jax.block_until_ready(fn(x, sizes, *w))
      calls[f"{kname} M={m}"] = (fn, [])
    reps = max(3, 200_000 // a)
    for _ in range(rounds):
      for fn, times in calls.values():
        c0 = time.process_time()
        for _ in range(reps):
          jax.block_until_ready(fn(x, sizes, *w))
        times.append((time.process_time() - c0) / reps * 1e3)
    ms = {k: min(t) for k, (_, t) in calls.items()}
    packed = routed == a
    chosen = (f"{'batched' if experts._batched_kernel(a, g, packed) else 'loop'} "
              f"M={experts.tile_rows(a, g, packed)}")
    best = min(ms, key=ms.get)
    # (M=256 is measured to show the trend; tile_rows stops at 128. On one device the batched
    # kernel is chosen for wall time, which CPU time does not show.)
    print(f"{name:14s} " + "  ".join(f"{k}: {v:.2f}" for k, v in ms.items())
          + f"   chosen {chosen} ({ms[chosen] / ms[best]:.2f} x the best, {best})", flush=True)
    results.append({"shape": name, "cpu_ms": ms, "chosen": chosen, "best": best})
  print(json.dumps({"bench": "step_tiles", "results": results}))


def make_batches(dims: str, count: int = 4):
  cfg = config(dims)
  rng = np.random.default_rng(0)
  out = []
  for _ in range(count):
    tokens = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  return out


def print_profile(v: Variant, run, steps: int = 3, top: int = 20):
  """`moejax.profiling` of one variant's step: its ops' time by moejax source line."""
  count = iter(range(3, 10**6))
  out = profiling.profile(v.compiled, (), calls=steps, top=top, run=lambda: run(next(count)))
  where = "device" if out["device_events"] else "host threads, waits included"
  print(f"\n{v.name}: ops {out['ms_per_call']:.0f} ms per step ({where}), {out['ops']} ops")
  for scope, ms in out["by_scope"].items():
    print(f"  {ms:9.1f} ms {ms / out['ms_per_call']:6.1%}  [{scope}]")
  for src, ms in out["by_source"].items():
    print(f"  {ms:9.1f} ms {ms / out['ms_per_call']:6.1%}  {src}")
  print("  largest ops:")
  for op in out["top_ops"][:10]:
    print(f"  {op['ms']:9.1f} ms  {op['op']:36s} {op['source']}  {op['op_name'][-60:]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sets = parser.add_mutually_exclusive_group()   # which variants (default: the full table)
  sets.add_argument("--quick", action="store_true",
                    help="peer dims: reference, 1 device, reference x8, fsdp x8")
  sets.add_argument("--experts", action="store_true", help="the number-of-experts sweep")
  sets.add_argument("--scaling", action="store_true",
                    help="peer dims: ep and fssdp on 2, 4 and 8 fake devices")
  sets.add_argument("--tiles", action="store_true",
                    help="the expert kernel's tile-size sweep (takes --rounds only)")
  parser.add_argument("--peer", action="store_true",
                      help="then run the MaxText comparison (exit code: its failure's)")
  parser.add_argument("--only", action="append", default=[],
                      help="keep the variants whose name contains this text (repeatable; a "
                      "substring: 'tiny reference' keeps 'tiny reference x8' too)")
  parser.add_argument("--profile", action="store_true",
                      help="per chosen variant: its step's time by moejax source line")
  parser.add_argument("--rounds", type=at_least(1), default=3,
                      help="rounds over the variants (each round times every variant in turn)")
  parser.add_argument("--steps", type=at_least(1), default=4,
                      help="timed steps per variant and round")
  args = parser.parse_args()
  if args.tiles and (args.only or args.profile):
    parser.error("argument --tiles: takes neither --only nor --profile")
  # Before any step runs, for the reference as for moejax (a Trainer on CPU does it too).
  kept = host_memory.keep_freed_memory_mapped()
  print(f"host memory: freed pages {'kept mapped' if kept else 'returned to the OS'} "
        f"(moejax.host_memory; {host_memory.ENV}=0 leaves malloc as it is)", flush=True)

  if args.tiles:
    tile_sweep(args.rounds)
    return
  every = variants(args)
  vs = [v for v in every if not args.only or any(o in v.name for o in args.only)]
  if not vs:
    parser.error(f"argument --only: no variant's name contains {' or '.join(map(repr, args.only))}"
                 f" (variants here: {', '.join(v.name for v in every)})")
  batches = {dims: make_batches(dims) for dims in DIMS}
  runs = {}
  for v in vs:
    t0 = time.perf_counter()
    runs[v.name] = v.build(batches[v.dims])
    for i in range(3):   # warm-up (codec variants: past their warm-up gathers)
      runs[v.name](i)
    print(f"compiled {v.name} in {time.perf_counter() - t0:.0f} s", flush=True)
  if args.profile:
    for v in vs:
      print_profile(v, runs[v.name])
    return
  i = 3
  for r in range(args.rounds):
    for v in vs:
      for _ in range(args.steps):
        t = time.perf_counter()
        runs[v.name](i)
        v.times.append(time.perf_counter() - t)
        i += 1
    print(f"round {r + 1}/{args.rounds} done", flush=True)

  median = {v.name: statistics.median(v.times) for v in vs}
  print("\n(GFLOP, GB accessed and peak MB are XLA's per device: an x8 row's are one device's of 8)")
  print(f"{'variant':24s} {'s/step':>8s} {'tok/s':>8s} {'GFLOP':>7s} {'GB':>6s} {'peak MB':>8s}"
        f" {'ratio':>6s}  vs")
  results = []
  for v in vs:
    base = v.baseline or (f"{v.dims} reference" if v.devices else "")
    ratio = median[v.name] / median[base] if base in median and base != v.name else None
    f = v.figures
    frac = v.compressed_fraction()
    extra = f"  compressed {frac:.0%} of gathered bytes" if frac is not None else ""
    also = median[v.name] / median[v.also] if v.also in median else None
    extra += f"  ({also:.2f} x {v.also})" if also is not None else ""
    print(f"{v.name:24s} {median[v.name]:8.4f} {v.tokens / median[v.name]:8.0f} "
          f"{f['gflop']:7.2f} {f['gb_accessed']:6.2f} {f.get('peak_mb', 0):8.1f} "
          f"{'' if ratio is None else f'{ratio:6.2f}':>6s}  {base if ratio else ''}{extra}")
    results.append({"variant": v.name, "s_per_step": median[v.name],
                    "tokens_per_s": v.tokens / median[v.name], **f, "ratio": ratio,
                    "vs": base if ratio else None, "compressed_fraction": frac,
                    **({"ratio_also": also, "vs_also": v.also} if also is not None else {})})
  print(json.dumps({"bench": "step", "results": results}))
  if args.peer:
    script = os.path.join(REPO, "..", "shared", "peers", "maxtext", "compare.sh")
    codes = [subprocess.run(["bash", script, REPO, "3"], check=False,
                            env={**os.environ, "DEVICES": devices, "XLA_FLAGS": ""}).returncode
             for devices in ("1", "8")]                   # both comparisons, whatever the first
    sys.exit(next((code for code in codes if code), 0))


if __name__ == "__main__":
  main()
