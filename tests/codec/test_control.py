"""The codec controller's pieces without a train step: the choice per parameter from measured rates
(modes, budget, hysteresis), the gatherer it builds, the mesh profile, the config fields."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from moejax.codec import gather as codec
from moejax.codec import select
from moejax.config import from_config_dict
from moejax.errors import ConfigError
from moejax.sharding.mesh import make_mesh
from moejax.train import codec_control
from moejax.train.optim import make_optimizer
from moejax.train.state import codec_spec, state_layout
from tests.helpers import tiny_config

import configs.olmoe as olmoe_configs

BYTES = select.CommModel.bytes_only()


@pytest.fixture(scope="module")
def gatherer():
  cfg = tiny_config()
  return state_layout(cfg, make_mesh((2, 4), jax.devices()[:8]), make_optimizer(cfg)).gatherer


def _rates(gatherer, element, block, word, delta=None, far=None):
  """The same (mean = worst) rates for every candidate. `delta`: escape rates at 2, 3, 4 code
  bits (default: every changed value escapes); `far`: moves beyond 127 units (default: all)."""
  names = tuple(gatherer.candidates())
  far = word if far is None else far
  mean = np.array([[element, block, word, *(delta or (word,) * 3), far]] * len(names))
  return codec_control.Rates(names, mean, mean.copy(), steps=3)


def _codec(**kw):
  return dataclasses.replace(tiny_config().codec, **{"mode": "auto", "block_size": 64, **kw})


def test_modes_follow_the_rates(gatherer):
  by_name = lambda sel, r: {f"{g}{p}": s for (g, p), s in zip(r.names, sel)}   # noqa: E731
  high = _rates(gatherer, 0.01, 0.9, 0.9)          # pretraining: few exponents, most words change
  sel = by_name(codec_control.choose(gatherer, high, _codec(), BYTES), high)
  assert sel["layers['moe']['w_up']"].spec.mode == "element"
  assert sel["final_norm"].spec.mode == "off" and sel["final_norm"].reason == "no gain"
  low = _rates(gatherer, 0.0005, 0.03, 0.02)       # fine-tuning: few words change
  sel = by_name(codec_control.choose(gatherer, low, _codec(), BYTES), low)
  assert sel["layers['moe']['w_up']"].spec.mode == "word"
  assert all(s.bytes_sent <= s.bytes_plain for s in sel.values())
  # Most values move by a unit or two in the last place: delta codes beat the word bitmap.
  moving = _rates(gatherer, 0.005, 0.9, 0.4, delta=(0.2, 0.02, 0.01), far=0.002)
  sel = by_name(codec_control.choose(gatherer, moving, _codec(), BYTES), moving)
  assert sel["layers['moe']['w_up']"].spec.mode == "delta"
  assert sel["layers['moe']['w_up']"].spec.delta_bits == 3   # 3 + 0.02 x 8 < 4 + 0.01 x 8 bits
  # A fixed mode with selection: that mode or plain, never another.
  fixed = codec_control.choose(gatherer, low, _codec(mode="block", select=True), BYTES)
  assert {s.spec.mode for s in fixed} <= {"block", "off"}


def test_budget_and_hysteresis(gatherer):
  low = _rates(gatherer, 0.0005, 0.03, 0.02)
  free = codec_control.choose(gatherer, low, _codec(), BYTES)
  full = sum(s.state_bytes for s in free if s.selected)
  tight = codec_control.choose(gatherer, low, _codec(cache_budget_bytes=full // 3), BYTES)
  used = sum(s.state_bytes for s in tight if s.selected)
  assert 0 < used <= full // 3
  assert any(s.reason in ("over budget", "cheaper mode (budget)") for s in tight)
  # A capacity in use is kept while the one sized from the rates is at most KEEP_RATIO below it,
  # and sized afresh once it falls further.
  specs = codec_control.specs_of(low.names, free)
  g, p = next((g, p) for g, ps in specs.items() for p in ps)
  fresh = specs[g][p].capacity_fraction
  need = select.capacity_fraction(0.02, _codec().capacity_margin, quantize=True)
  kept = round(need * codec_control.KEEP_RATIO * 0.9, 4)
  assert kept != fresh
  for current_fraction, expected in [(kept, kept),
                                     (need * codec_control.KEEP_RATIO * 1.1, fresh)]:
    current = {g: {p: dataclasses.replace(specs[g][p], capacity_fraction=current_fraction)}}
    again = codec_control.choose(gatherer, low, _codec(), BYTES, current)
    assert codec_control.specs_of(low.names, again)[g][p].capacity_fraction == expected


def test_gatherer_with_specs(gatherer):
  spec = codec.CodecSpec("word", block_size=64, capacity_fraction=0.25)
  g = gatherer.with_specs({"layers": {"['moe']['w_up']": spec, "['moe']['w_down']":
                                      codec.CodecSpec("off")}})
  assert g.specs["layers"] == {"['moe']['w_up']": spec} and g.enabled
  assert g.state_bytes_by_mode() == {"word": g.param_state_bytes("layers", "['moe']['w_up']")}
  assert [r[:2] for r in g.param_rows()] == [("layers", "['moe']['w_up']")] * g.copies("layers")
  with pytest.raises(ValueError, match="not a sharded parameter"):
    gatherer.with_specs({"layers": {"['nope']": spec}})


def test_profile_fits_a_model_of_this_mesh():
  # Sizes 512x apart: on a loaded 2-core machine 64x apart sometimes timed the larger faster.
  comm = codec_control.profile_comm(make_mesh((2, 4), jax.devices()[:8]), sizes=(1 << 12, 1 << 21),
                                    reps=2, repeats=3)
  assert comm.alpha >= 0 and comm.beta > 0


def test_config_fields():
  cfg = tiny_config(**{"codec.mode": "auto", "codec.cache_budget_bytes": 10**6,
                       "codec.reselect_every": 50, "codec.comm_model": "bytes"})
  assert cfg.codec.controlled and codec_spec(cfg) is None       # plain until the first decision
  assert tiny_config(**{"codec.mode": "word"}).codec.controlled is False
  assert codec_spec(tiny_config(**{"codec.mode": "word"})).mode == "word"
  assert tiny_config(**{"codec.mode": "element", "codec.select": True}).codec.controlled
  for overrides, field in [({"codec.select": True}, "codec.select"),
                           ({"codec.cache_budget_bytes": -1}, "codec.cache_budget_bytes"),
                           ({"codec.reselect_every": -5}, "codec.reselect_every"),
                           ({"codec.capacity_margin": 0.5}, "codec.capacity_margin"),
                           ({"codec.comm_model": "fast"}, "codec.comm_model"),
                           ({"codec.mode": "word", "codec.detect": "hash"}, "codec.detect")]:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      tiny_config(**overrides)
  for preset in olmoe_configs.PRESETS:
    assert from_config_dict(olmoe_configs.get_config(preset)).codec.mode == "off"


def test_codec_work_is_profiled_and_counts_against_the_gain(gatherer):
  seconds = codec_control.profile_codec(("element", "word"), 8, sizes=(1 << 12, 1 << 18),
                                        repeats=2)
  assert set(seconds) == {"element", "word"}
  assert all(alpha >= 0 and beta > 0 for alpha, beta in seconds.values())
  low = _rates(gatherer, 0.0005, 0.03, 0.02)
  comm = select.CommModel(0.0, 1e-9)                # seconds: 1 GB/s, no latency
  free = codec_control.choose(gatherer, low, _codec(), comm)
  assert any(s.selected for s in free)
  cheap = codec_control.choose(gatherer, low, _codec(), comm,
                               codec_seconds={m: (1e-7, 0.0) for m in codec_control.modes_of(
                                   _codec())})
  same = [(a, b, g) for a, b, (g, _) in zip(free, cheap, low.names)
          if a.selected and b.spec == a.spec]
  assert same
  for a, b, g in same:   # the same choice, its work subtracted (not on rebuilt gathers, in
    moving = 1.0 - gatherer.rebuilt_share.get(g, 0.0)   # every mode)
    assert b.gain_s == pytest.approx(a.gain_s - gatherer.copies(g) * moving * 1e-7)
  # Work that costs more than any collective saves: nothing pays.
  costly = codec_control.choose(gatherer, low, _codec(), comm,
                                codec_seconds={m: (1.0, 0.0) for m in ("element", "block",
                                                                      "word", "delta")})
  assert not any(s.selected for s in costly)


def test_a_saved_schedule_of_other_shapes_is_set_aside(gatherer):
  """A checkpoint's probe counts from another mesh (8 devices there, 4 here) do not fit this
  run's: one line says so, and the next decision probes afresh instead of failing later."""
  mesh = make_mesh((1, 4), jax.devices()[:4])
  small = state_layout(tiny_config(), mesh, make_optimizer(tiny_config())).gatherer
  lines = []
  policy = codec_control.CodecPolicy(small, mesh, _codec(comm_model="bytes"), log=lines.append)
  r, k = sum(policy.probe.rows), len(codec_control.RATE_KINDS)
  saved = {"next": 9, "probe_steps": 2, "acc": [np.zeros((8, r, k)).tolist()] * 2
           + [np.zeros((r, k)).tolist()], "live": None, "live_prev": None, "live_steps": 0,
           "live_since": 0}
  assert not policy._resume_schedule(saved, 7, params=None)
  assert policy._next != 9 and policy._acc is None
  assert len(lines) == 1 and "probe counts" in lines[0] and "probing afresh" in lines[0]
  # The same counts for this mesh's 4 devices are taken up.
  saved["acc"] = [np.ones((4, r, k), int).tolist()] * 2 + [np.ones((r, k), int).tolist()]
  saved["next"] = 20                         # outside the window: no snapshot of params needed
  assert policy._resume_schedule(saved, 7, params=None)
  assert policy._next == 20 and policy._probe_steps == 2
  assert [a.shape for a in policy._acc] == [(4, r, k), (4, r, k), (r, k)]
  assert int(policy._acc[0].sum()) == 4 * r * k


def test_a_restored_choice_outside_this_runs_codec_config_is_decided_afresh(gatherer, tmp_path):
  """A resume may change codec.*: a checkpoint's choice that compresses with a mode the run's
  codec.mode does not allow, or keeps caches over its codec.cache_budget_bytes, was reinstalled
  silently (and with reselect_every=0 kept for good). Now one line says why, and the run
  decides afresh after its warm-up; a choice that fits is reinstalled."""
  mesh = make_mesh((2, 4), jax.devices()[:8])
  (g, p) = next(iter(gatherer.candidates()))
  saved = {"step": 5, "specs": [codec_control._spec_entry(g, p, codec.CodecSpec("delta"))],
           "schedule": {"next": None, "probe_steps": 0, "acc": None, "live": None,
                        "live_prev": None, "live_steps": 0, "live_since": 0}}
  cases = [(dict(mode="element", select=True), "codec.mode='element' does not allow"),
           (dict(cache_budget_bytes=100), "over codec.cache_budget_bytes=100"),
           (dict(), None)]
  # A choice priced otherwise (another comm model or margin, another block size) is decided
  # afresh too; a checkpoint of an older version, which names no pricing, is reinstalled.
  priced_by = {"comm_model": "bytes", "capacity_margin": 1.25, "block_size": 64, "delta_bits": 3}
  cases += [(dict(), None, {**priced_by}),
            (dict(comm_model="profile"), "made with codec.comm_model='bytes', this run's is "
             "'profile'", {**priced_by}),
            (dict(capacity_margin=2.0), "codec.capacity_margin=1.25, this run's is 2.0",
             {**priced_by})]
  # Either way the run's decision log keeps the decisions up to the step it resumes at (a fresh
  # decision rewrote the file with its own alone).
  logged = {"decisions": [{"step": 2}, {"step": 5}, {"step": 8}]}
  for overrides, why, *priced in cases:
    lines = []
    workdir = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
    workdir.mkdir()
    (workdir / codec_control.SELECTION_FILE).write_text(json.dumps(logged))
    policy = codec_control.CodecPolicy(
        gatherer, mesh, _codec(**{"reselect_every": 0, "comm_model": "bytes", **overrides}),
        log=lines.append, comm=BYTES, workdir=str(workdir))
    policy.restored = dict(saved, **({"priced_by": priced[0]} if priced else {}))
    choice = policy.start(5, params=None)
    if why is None:
      assert choice[g] == {p: codec.CodecSpec("delta")} and policy._next is None
      assert "reinstalled the codec choice of step 5" in lines[0]
    else:
      assert len(lines) == 1 and why in lines[0] and "deciding afresh" in lines[0], lines
      assert choice is None and policy._next is not None     # a decision comes after all
    assert [d["step"] for d in policy.decisions] == [2, 5]


def test_a_fixed_mode_that_keeps_falling_back_is_said_once():
  """codec.mode=element without select decides nothing, and a parameter whose patches overflow
  in most gathers saved nothing with no word but a summed metric: one line now names it (its
  count over the steps watched) and the remedies, once; a window under the limit says nothing."""
  from moejax.sharding import hook
  from moejax.sharding.gatherer import PARAM_METRIC
  cfg = tiny_config(**{"codec.mode": "element"})
  mesh = make_mesh((2, 4), jax.devices()[:8])
  fixed = state_layout(cfg, mesh, make_optimizer(cfg)).gatherer
  lines = []
  policy = codec_control.CodecPolicy(fixed, mesh, cfg.codec, log=lines.append)
  assert not policy.active and policy._watch
  rows = fixed.param_rows()
  column = hook.STAT_KEYS.index("fallback")

  def figures(row=None):
    f = np.zeros((len(rows), len(hook.STAT_KEYS)), np.float32)
    if row is not None:
      f[row, column] = 1.0
    return {PARAM_METRIC: jax.numpy.asarray(f), "loss": 1.0}

  step = 0
  for _ in range(codec_control.CHECK_EVERY):             # three in nine steps: under half
    step += 1
    metrics, choice = policy.after_step(step, None, figures(3 if step % 3 == 0 else None))
    assert choice is None and PARAM_METRIC not in metrics
  assert lines == []
  for _ in range(3 * codec_control.CHECK_EVERY):          # row 7 falls back in every gather
    step += 1
    policy.after_step(step, None, figures(7))
  g, p, layer = rows[7]
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"codec: step {2 * codec_control.CHECK_EVERY}: {g}{p} (layer "
                             f"{layer}) fell back to a plain gather 9 times in 9 steps under "
                             "codec.mode='element' (1 of ")
  assert "raise codec.capacity_fraction (now the mode default)" in lines[0]
  # codec.mode=auto (or select) decides again on fallbacks instead; off has nothing to watch.
  for mode in ({"codec.mode": "auto"}, {"codec.mode": "element", "codec.select": True}):
    auto_cfg = tiny_config(**mode, **{"codec.comm_model": "bytes"})
    assert not codec_control.CodecPolicy(fixed, mesh, auto_cfg.codec, log=print)._watch


def test_a_resume_across_fixed_and_auto_modes_says_what_it_leaves(gatherer):
  """A fixed mode's checkpoints hold a codec item too (no decision, its mode): resumed under
  auto it decides after its warm-up (it said "written by an older version"); an auto run's
  choice resumed under a fixed mode is set aside with one line (it was silent). Off saves none."""
  mesh = make_mesh((2, 4), jax.devices()[:8])
  cfg = tiny_config(**{"codec.mode": "element"})
  fixed_gatherer = state_layout(cfg, mesh, make_optimizer(cfg)).gatherer
  lines = []
  fixed = codec_control.CodecPolicy(fixed_gatherer, mesh, cfg.codec, log=lines.append)
  (item,) = fixed.checkpoint_items
  saved = item.item(state=None)[0]
  assert saved == {"step": None, "mode": "element", "specs": [], "schedule": None}
  off = codec_control.CodecPolicy(gatherer, mesh, tiny_config().codec, log=lines.append)
  assert off.checkpoint_items == ()
  auto = codec_control.CodecPolicy(gatherer, mesh, _codec(comm_model="bytes"),
                                   log=lines.append)
  auto.restored = json.loads(json.dumps(saved))         # through JSON, as a checkpoint holds it
  assert auto.start(4, params=None) is None and auto.decided_at is None
  assert auto._next == max(auto.cfg.warmup_steps, 4 + codec_control.PROBE_STEPS)
  assert lines == []
  (g, p) = next(iter(gatherer.candidates()))
  fixed.restored = {"step": 5, "specs": [codec_control._spec_entry(g, p, codec.CodecSpec("delta"))],
                    "schedule": None}
  assert fixed.start(7, params=None) is None
  assert lines == ["codec: the checkpoint's codec choice (step 5, 1 parameter compressed) is set "
                   "aside: codec.mode='element' without codec.select compresses every parameter "
                   "it gathers"]
  # a checkpoint with no codec item (an off run's, or an older version's) is news to auto only
  for policy in (fixed, auto):
    codec_control.CodecDecisionItem(policy).restore(None, None, "checkpoint 3", lines.append)
  assert len(lines) == 2 and lines[1].startswith("codec: checkpoint 3 holds no codec decision")
