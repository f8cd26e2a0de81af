"""Training with the compressed all-gather is bit-identical to training without it, whatever the
codec does between steps: `codec.mode=auto` (plain warm-up, a decision from probed change rates, a
re-decision on live rates, logged) and then a hand-made mix of every mode (element, block, word,
delta, plain) installed mid-run in its place. (Block hashes and each mode's fallback are covered
gather by gather in test_gather.py.)

Both runs train the suite's codec.mode=auto Trainer (tests/conftest.py `codec_auto_run`) on that
run's own batches: the plain run is its plain step, and the codec run's first decision is the
run's, so both reuse its compiles; only the second decision and the mix compile here."""
import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.codec import gather as codec
from moejax.models import olmoe
from moejax.sharding import hook
from moejax.sharding.gatherer import PARAM_METRIC
from moejax.sharding.hook import STAT_KEYS
from moejax.train import codec_control, step as step_lib
from moejax.train.loop import put_batch, training_data
from tests.helpers import CODEC_AUTO_RUN, CODEC_AUTO_STEPS, tiny_config

STEPS = CODEC_AUTO_STEPS
# Decisions after steps 3 and 6; the second is logged, and a hand-made mix of every mode is
# installed in its place (one compile fewer than installing both).
FIRST, SECOND = CODEC_AUTO_RUN["codec.warmup_steps"], 6
MIXED = SECOND
# The run's settings (a constant learning rate: change rates fall slowly from the first decision
# on, so the second decision usually keeps the choice and needs no new compile), deciding again
# every 3 steps.
CONTROLLER = tiny_config(**CODEC_AUTO_RUN, **{"codec.reselect_every": SECOND - FIRST}).codec


def _mixed(gatherer):
  """Every mode somewhere; the attention projections keep the spec auto gave them (their caches
  must survive the switch)."""
  spec = lambda mode, fraction, **kw: codec.CodecSpec(  # noqa: E731
      mode, block_size=64, capacity_fraction=fraction, warmup_steps=FIRST, **kw)
  # w_gate keeps auto's delta2 state at a capacity its changes fit (a patch, never a fallback).
  layers = {"['moe']['w_gate']": spec("delta", 0.5, delta_bits=2),
            "['moe']['w_up']": spec("block", 0.5),
            "['moe']['w_down']": spec("element", 0.125),
            "['moe']['router']": spec("element", 0.25),
            "['attn_norm']['scale']": spec("word", 0.125)}
  for path in ("['attn']['wq']", "['attn']['wk']", "['attn']['wv']", "['attn']['wo']"):
    if path in gatherer.specs["layers"]:
      layers[path] = gatherer.specs["layers"][path]
  # Room for every value: a kept cache must patch at once, never fall back.
  return {"embed": {"": spec("word", 1.0)}, "lm_head": {"": spec("block", 1.0)},
          "layers": layers}


@pytest.fixture(scope="module")
def runs(codec_auto_run, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("codec"))
  plain = codec_auto_run[0]
  trainer = copy.copy(plain)          # shares the run's compiled steps; compiles its own after
  trainer._compiled = dict(plain._compiled)
  data = training_data(plain.cfg)
  lines = []
  controller = codec_control.CodecPolicy(trainer.layout.gatherer, trainer.mesh, CONTROLLER,
                                         workdir=workdir, log=lines.append)
  s_plain, s_codec = plain.init_state(), trainer.init_state()
  compiled = trainer.compiled(trainer.layout.gatherer.specs)
  assert controller.start(0, s_codec.params) is None
  out = {"plain": [], "codec": [], "snaps": [], "codec_rows": []}
  for step in range(1, STEPS + 1):
    batch = put_batch(next(data.train), plain.mesh)
    if step >= MIXED:      # the parameters this step gathers, for the probe-vs-codec check
      out["snaps"].append(controller.probe.snapshot(s_codec.params))
    s_plain, m_plain = plain.train_step(s_plain, batch)
    s_codec, m_codec = compiled.train_step(s_codec, batch)
    raw, rows = m_codec.get(PARAM_METRIC), compiled.layout.gatherer.param_rows()
    m_codec, choice = controller.after_step(step, s_codec.params, m_codec)
    if step == MIXED:
      out["mixed"] = _mixed(compiled.layout.gatherer)
      # shards whose patch would be no smaller than their values: always dense
      sizes = {(g, p): codec.wire_bytes(compiled.layout.gatherer.shard_shape(g, p),
                                        hook.COMPUTE_DTYPE, spec)
               for g, ps in out["mixed"].items() for p, spec in ps.items()}
      out["always_dense"] = {k for k, s in sizes.items() if s["forward"] != s["compressed"]}
      choice = controller.force(step, out["mixed"], keep_deciding=False)
    if choice is not None:
      s_codec, compiled = trainer.adopt(s_codec, compiled, choice)
    if step > MIXED:
      out["codec_rows"].append((raw, rows))
    out["plain"].append(m_plain)
    out["codec"].append(dict(m_codec, specs=copy.deepcopy(compiled.layout.gatherer.specs)))
  out["plain"], out["codec"] = jax.device_get((out["plain"], out["codec"]))
  out["params"] = jax.device_get((s_plain.params, s_codec.params))
  out.update(controller=controller, lines=lines, workdir=workdir, trainer=trainer)
  return out


def test_bitwise_identical_training(runs):
  losses = [[float(m["loss"]) for m in runs[k]] for k in ("plain", "codec")]
  assert losses[0] == losses[1]
  for a, b in zip(*(jax.tree.leaves(p) for p in runs["params"])):
    np.testing.assert_array_equal(a, b)


def test_auto_decisions(runs):
  ctl = runs["controller"]
  assert [d["step"] for d in ctl.decisions] == [FIRST, SECOND]
  with open(os.path.join(runs["workdir"], codec_control.SELECTION_FILE)) as f:
    assert json.load(f)["decisions"] == json.loads(json.dumps(ctl.decisions))
  first = {e["group"] + e["path"]: e for e in ctl.decisions[0]["params"]}
  # Norms cost more than they save (8 values per shard); the experts compress.
  assert first["final_norm"]["mode"] == "off" and first["final_norm"]["reason"] == "no gain"
  assert first["layers['moe']['w_up']"]["mode"] in ("element", "word", "delta", "block")
  # Per step, each compressed parameter sends less than plain (the gathers the backward rebuilds
  # from its cache move little or nothing, so one gather may cost a little more).
  for e in first.values():
    assert e["mode"] == "off" or e["bytes_sent_step"] < e["bytes_plain"]
  # One header and one line per parameter per decision.
  assert len(runs["lines"]) == 2 * (1 + len(first))
  assert all(line.startswith("codec:") for line in runs["lines"])
  # Before the first decision everything is plain; after it the chosen parameters compress.
  before, after = runs["codec"][FIRST - 1], runs["codec"][FIRST + 1]
  assert "codec_params" not in before
  assert after["codec_params"] == sum(e["mode"] != "off" for e in first.values())
  assert after["gather_bytes"] < after["gather_bytes_plain"]
  assert after["codec_cache_bytes"] == ctl.decisions[0]["cache_bytes"]
  assert PARAM_METRIC not in after          # taken out for metrics.jsonl


def test_mixed_modes_keep_unchanged_caches(runs):
  first_mixed = runs["codec"][MIXED]        # metrics of the step after the switch
  for mode in ("word", "delta", "block", "element"):
    assert first_mixed[f"codec/cache_bytes/{mode}"] > 0
  before = runs["codec"][MIXED - 2]["specs"]   # in force for step MIXED (chosen after MIXED-1)
  kept = {(g, p) for g, ps in runs["mixed"].items() for p, spec in ps.items()
          if p in before.get(g, {}) and codec.same_state(before[g][p], spec)}
  mixed = {(g, p) for g, ps in runs["mixed"].items() for p in ps}
  assert kept and kept != mixed                         # some caches kept, some states new
  dense = STAT_KEYS.index("dense")
  raw, rows = runs["codec_rows"][0]
  for (g, p, _), row in zip(rows, np.asarray(jax.device_get(raw))):
    # Same state (only the capacity changed, or nothing): a patch at once, unless the patch
    # would be no smaller than the values (word / block at capacity 1.0). New state: refill.
    assert row[dense] == (0 if (g, p) in kept - runs["always_dense"] else 1), (g, p)
  assert kept - runs["always_dense"]


def test_probe_counts_what_the_codec_counts(runs):
  """The controller's probe and the codec agree on every compressed parameter's changes."""
  probe = runs["controller"].probe
  cols = [STAT_KEYS.index(k) for k in ("exponent_changes", "block_changes",
                                              "word_changes")]
  index = {name: i for i, name in enumerate(probe.names)}
  offsets = np.cumsum([0] + probe.rows)
  snaps = runs["snaps"]                     # snaps[k]: what step MIXED + k gathered
  for j in range(1, len(runs["codec_rows"])):
    raw, rows = runs["codec_rows"][j]       # step MIXED + 1 + j
    counts = np.asarray(jax.device_get(probe.compare(snaps[j], snaps[j + 1]))).sum(axis=0)
    specs = runs["codec"][MIXED + j]["specs"]
    checked = 0
    for (g, p, layer), row in zip(rows, np.asarray(jax.device_get(raw))):
      expected, spec = counts[offsets[index[(g, p)]] + layer], specs[g][p]
      assert row[cols[1]] == expected[1], (g, p, layer)
      if spec.detect == "exact":
        assert row[cols[0]] == expected[0], (g, p, layer)
      if spec.mode in codec.WORD_MODES:
        assert row[cols[2]] == expected[2], (g, p, layer)
      checked += int(expected[0] > 0)
    assert checked > 0


def test_word_and_delta_bytes_count_their_forward_gathers_only(runs):
  """A compressed parameter's prefetched backward re-gathers are rebuilt from its cache
  (tests/sharding/test_prefetch.py): word / delta move nothing, element / block their
  sign+mantissa bits. A step's gather_bytes count them so, the plain figure every gather as a
  plain gather (the mixed run: every mode somewhere)."""
  gatherer, cfg = runs["trainer"].layout.gatherer, runs["trainer"].cfg
  n, specs = gatherer.num_devices, runs["mixed"]
  raw, rows = runs["codec_rows"][1]                  # step MIXED + 2
  metrics = runs["codec"][MIXED + 1]
  sent, plain = (STAT_KEYS.index(k) for k in ("bytes_sent", "bytes_plain"))
  coded_sent = coded_plain = 0.0
  rebuilt = 0
  for (g, p, _), row in zip(rows, np.asarray(jax.device_get(raw))):
    every = step_lib.gathers_per_copy(cfg, gatherer, g)
    scans = olmoe.scanned_layers(cfg, g)
    moved = every if not scans else hook.gathers_per_layer(scans, remat=cfg.remat,
                                                           prefetch=cfg.prefetch, rebuilt=True)
    again = codec.wire_bytes(gatherer.shard_shape(g, p), jnp.bfloat16, specs[g][p])["rebuilt"]
    rebuilt += moved < every and specs[g][p].mode not in codec.WORD_MODES and again > 0
    coded_sent += (row[sent] * moved + again * (every - moved)) * (n - 1)
    coded_plain += row[plain] * (n - 1) * every
  assert rebuilt > 0
  uncoded = metrics["gather_bytes_plain"] - coded_plain     # parameters the codec leaves plain
  np.testing.assert_allclose(metrics["gather_bytes"], uncoded + coded_sent, rtol=1e-5)
