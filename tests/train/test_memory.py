"""moejax.train.memory: per-device memory by component from the config alone. Here the presets
at scale (no compile); tests/sharding/test_memory.py checks the report against XLA's memory
analysis of the compiled tiny step on 8 devices."""
import dataclasses
import re

import pytest

from configs import olmoe as olmoe_configs
from moejax.config import from_config_dict
from moejax.errors import ConfigError
from moejax.train.memory import MemoryReport, check_fits, memory_report
from tests.helpers import tiny_config

GB80 = 80 * 10**9          # an 80 GB accelerator (A100/H100-80G)


def _1b7b(batch_size: int | None = None, **moe):
  cd = olmoe_configs.get_config("1b7b")
  cd.moe.update(**moe)
  if batch_size:
    cd.batch_size = batch_size
  return from_config_dict(cd)


@pytest.mark.parametrize("placement", ["fsdp", "ep", "fssdp"])
def test_1b7b_full_batch_on_64_devices_fits_80_gb_with_the_default_capacities(placement):
  cfg = _1b7b(placement=placement)
  report = memory_report(cfg, 64)
  assert report.total < GB80, report.table()
  # Every device holds 1/64 of the parameters (fp32 masters) and twice that of Adam moments.
  whole = 6.92e9 * 4
  assert 0.99 * whole / 64 < report.components["parameters"] < 1.01 * whole / 64
  assert report.components["optimizer"] == pytest.approx(2 * report.components["parameters"],
                                                         rel=1e-3)
  if placement != "fsdp":       # bounded buffers: a fraction of the dropless worst case (N x T
    # rows: a token sends one row to a device holding one of its experts; ep holds 1 of 64)
    every_row = dict(dispatch_capacity_factor=0.0, receive_capacity_factor=0.0)
    for packed in (True, False):
      dropless = memory_report(_1b7b(placement=placement, **every_row), 64,
                               packed_exchange=packed)
      bounded = memory_report(cfg, 64, packed_exchange=packed)
      assert 0 < bounded.components["exchange"] < 0.3 * dropless.components["exchange"]
    # Packed buffers (the GPU's) apply no dispatch cap under "grow": the same bytes dropless.
    packed_dropless = memory_report(_1b7b(placement=placement, dispatch_capacity_factor=0.0), 64)
    assert packed_dropless.components == report.components
    assert bounded.components["exchange"] > report.components["exchange"]   # blocks: N x C


@pytest.mark.parametrize("packed,receive,bound", [
    (False, 0.0, "dispatch_capacity_factor"), (True, 0.0, "dispatch_capacity_factor"),
    (True, 400.0, "receive_capacity_factor")], ids=["blocks", "packed", "packed uncapped"])
def test_dropless_dispatch_at_scale_does_not_fit_and_stops_with_one_line(packed, receive, bound):
  """The worst-case buffers (N x T x min(K, experts held) rows per device), the default before
  capacities were bounded, at 8x the preset's batch (512 x 4096): over 80 GB for ep alone,
  dropless blocks (the CPU's), or packed buffers (the GPU's) whose experts run every row they
  may receive, or as many as a receive capacity of 400 x T x K lets in (uncapped sends). The
  error names the field that sizes them (the dispatch cap sizes capped sends' receive buffers;
  uncapped, the receive capacity), and its bounded setting fits."""
  cfg = _1b7b(placement="ep", dispatch_capacity_factor=0.0, receive_capacity_factor=receive,
              batch_size=512)
  report = memory_report(cfg, 64, packed_exchange=packed)
  assert report.largest == "exchange" and report.components["exchange"] > GB80
  with pytest.raises(ConfigError) as e:
    check_fits(cfg, 64, GB80, packed_exchange=packed)
  message = str(e.value)
  assert message.startswith(f"config.moe.{bound}: the train step needs about ")
  assert "more than the device's 74.51 GiB; exchange alone takes" in message
  assert "\n" not in message
  fixed = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **{bound: 2.0}))
  assert check_fits(fixed, 64, GB80, packed_exchange=packed).total < GB80


def test_remat_policies_order_the_activations():
  """What a layer keeps for its backward: full < minimal < none."""
  sizes = [memory_report(dataclasses.replace(_1b7b(), remat=r), 64).components["activations"]
           for r in ("full", "minimal", "none")]
  assert sizes == sorted(sizes) and sizes[0] < sizes[2]


def test_the_trainers_check_refuses_only_past_the_reports_accuracy():
  """The Trainer checks with `TOLERANCE` (the report is within 10% of XLA's buffers): a step
  estimated 5% over the device's memory may fit and runs; 20% over stops."""
  from moejax.train.memory import FIELDS, TOLERANCE
  cfg = _1b7b(placement="ep")
  report = memory_report(cfg, 64)
  check_fits(cfg, 64, int(report.total / 1.05), tolerance=TOLERANCE)
  field = FIELDS[report.largest]                     # the largest component's field
  with pytest.raises(ConfigError, match=re.escape(f"config.{field}: the train step")):
    check_fits(cfg, 64, int(report.total / 1.2), tolerance=TOLERANCE)


def test_the_replica_codec_adds_its_caches_at_scale_and_still_fits():
  """fssdp's replica codec (on with the codec): each layer and device keeps last step's C owned
  experts and M replicas as bf16 bit patterns, twice while a step runs (its new ones beside
  them; the slots' experts every fssdp run keeps); 1b7b on 64 devices (C = 2, M = 2) still fits
  80 GB."""
  cd = olmoe_configs.get_config("1b7b")
  cd.moe.placement = "fssdp"
  plain = memory_report(from_config_dict(cd), 64)
  cd.codec.mode = "delta"
  coded = memory_report(from_config_dict(cd), 64)
  expert = 3 * 2048 * 1024 * 2                  # one expert's three matrices in bf16
  per_layer = (2 + 2) * expert + 1
  assert (coded.components["placement"] - plain.components["placement"]
          == 2 * 16 * per_layer)
  assert coded.total < GB80, coded.table()


def test_a_split_that_training_would_refuse_is_refused_here_too():
  """`--memory_on_devices` plans devices it has not got: what training on them would refuse
  (a batch or an expert count that does not divide) stops with the same line, not a traceback
  or a table for a step that cannot run."""
  with pytest.raises(ConfigError, match="config.batch_size=16 is not divisible by the 3 devices"):
    memory_report(tiny_config(), 3)
  with pytest.raises(ConfigError, match="config.moe.num_experts=8 is not divisible by the 16 "):
    memory_report(tiny_config(**{"moe.placement": "ep"}), 16)
  with pytest.raises(ConfigError, match=r"config.mesh.shape=\(2, 8\) needs 16 devices, but 8 "):
    memory_report(tiny_config(**{"mesh.shape": (2, 8)}), 8)      # was ignored here


def test_the_table_reads_at_every_size():
  """The tiny preset's parts printed as 0.00 GiB: each figure takes the unit that fits it."""
  report = MemoryReport(8, {"params": 3.0 * 2**30, "activations": 5.2 * 2**20,
                                "gathered": 1536.0, "exchange": 12.0})
  lines = report.table().splitlines()
  assert lines[0].split()[-2:] == ["3.00", "GiB"]
  assert lines[1].split()[-2:] == ["5.20", "MiB"]
  assert lines[2].split()[-2:] == ["1.50", "KiB"]
  assert lines[3].split()[-2:] == ["12", "B"]
  wide = MemoryReport(8, {"batch": 5.0, "activations": 1023.99 * 2**20}).table().splitlines()
  assert len({len(line) for line in wide}) == 1        # "1023.99 MiB" keeps the column


def test_fssdp_replica_rows_do_not_grow_with_the_device_count():
  """fssdp's GPU exchange holds the send rows (bf16) and SparseReduceScatter's fp32 gradient rows
  of at most `fssdp.owner_sends` (default t) replicas per owner, for the planned and the late
  (calibrated) gather: the same rows over ep's at 64 and 256 devices for DeepSeek-V3's experts.
  Unbounded (owner_sends=0, every slot of every device from one owner) they were N x M rows:
  253 GiB a device at 256 devices (2.6 GiB bounded)."""
  from configs import deepseek as deepseek_configs

  def exchange(placement, n, **fssdp):
    cd = deepseek_configs.get_config("v3")
    cd.batch_size = 256
    cd.moe.placement = placement
    cd.fssdp.update(**fssdp)
    return memory_report(from_config_dict(cd), n).components["exchange"]

  expert = 3 * 7168 * 2048                          # one expert's values
  per_row = expert * (2 + 4)                        # its bf16 row sent, its fp32 gradient back
  # Beside them, the M = 2 replicas' fp32 gradients sent and the C owned experts' summed
  # (C = 2E/N: 8 on 64 devices, 2 on 256).
  fp32_sums = {64: (2 + 8) * expert * 4, 256: (2 + 2) * expert * 4}
  for n in (64, 256):
    assert (exchange("fssdp", n) - exchange("ep", n)
            == 2 * 4 * per_row + fp32_sums[n])     # t = 4 rows, the planned and the late gather
  assert (exchange("fssdp", 256, owner_sends=0) - exchange("ep", 256)
          == 2 * 256 * 2 * per_row + fp32_sums[256])
  assert (exchange("fssdp", 256, owner_sends=6) - exchange("ep", 256)
          == 2 * 6 * per_row + fp32_sums[256])


def test_sparse_attention_counts_its_materialized_scores():
  """DeepSeek-V3.2 at 4096 tokens a sequence, one a device: past index_topk keys the attention
  over the selection holds a block of 512 queries' fp32 scores, probabilities and their
  gradients [H, 512, S], fp32 k and v, and the mask twice (found by review: the estimate had
  counted fused attention), none of it with no more keys than index_topk; the indexer's
  blocks beside them (6.2 GiB in all); without training the indexer, its loss's blocks go."""
  from configs import deepseek_v32
  cfg = from_config_dict(deepseek_v32.get_config("v32"))
  cd = deepseek_v32.get_config("v32")
  cd.model.index_topk = 4096
  short = from_config_dict(cd)
  activations = lambda c: memory_report(c, 64).components["activations"]   # noqa: E731
  scores = 512 * 4096 * 4 * 128 * 4 + 2 * 4096 * 4096 + 4096 * 128 * (192 + 128) * 4
  blocks = 512 * 4096 * 4 * (64 + 128)
  assert activations(cfg) - activations(short) == scores
  frozen = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, train_indexer=False))
  assert activations(cfg) - activations(frozen) == 512 * 4096 * 4 * 128
  assert (scores + blocks) / 2 ** 30 == pytest.approx(6.2, abs=0.1)
