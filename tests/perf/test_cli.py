"""python -m moejax.perf in process: table, plot, a run's metrics, errors."""
import json

from moejax.perf import cli


def test_cli_table_and_plot(tmp_path, capsys):
  png = tmp_path / "p.png"
  rc = cli.main(["--model", "OLMoE-1B-7B", "--layers", "2", "--cluster", "ciera-a100",
                 "--gpus", "8,16", "--seq-len", "1024", "--plot", str(png)])
  out = capsys.readouterr().out
  assert rc == 0
  assert png.stat().st_size > 10_000
  rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])]
  assert {r[1] for r in rows} == {"zero3", "ciera", "fsdp", "moejax-block", "moejax-auto"}
  assert all(r[-2].endswith("x") for r in rows)
  assert "all-gather" in out and "framework" in out
  assert "*" not in out                             # 2 layers fit an A100's 80 GB
  # Mixtral's full model on 8 H100s does not: its rows are marked, with a note
  assert cli.main(["--model", "Mixtral-8x7B", "--cluster", "h100", "--gpus", "8,64",
                   "--systems", "fsdp", "--plot", ""]) == 0
  out = capsys.readouterr().out
  memory = {r.split()[0]: r.split()[-1] for r in out.splitlines()
            if r.split()[:1] in (["8"], ["64"])}
  assert memory["8"].endswith("*") and float(memory["8"][:-1]) > 80
  assert not memory["64"].endswith("*") and float(memory["64"]) < 80
  assert "note: * the state alone needs more memory per GPU than the h100's 80 GB" in out


def test_cli_preset_with_metrics_and_ep(tmp_path, capsys):
  metrics = tmp_path / "metrics.jsonl"
  with open(metrics, "w") as f:
    f.writelines(json.dumps({"step": step, "loss": 3.0, "gather_bytes": 40.0,
                          "gather_bytes_plain": 100.0, "codec/experts/bytes_sent": 30.0,
                          "codec/experts/bytes_plain": 90.0, "load_max": [30.0, 20.0],
                          "load_mean": [10.0, 10.0], "expert_load_LxE": [[1] * 4] * 2})
                + "\n" for step in range(10, 80, 10))
  rc = cli.main(["--config", "configs/olmoe.py:tiny", "--cluster", "h100", "--gpus", "8",
                 "--metrics", str(metrics), "--plot", "",
                 "--systems", "fsdp,moejax-auto,moejax-ep,moejax-fssdp", "--steps", "2"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "codec byte ratio 0.400 of plain" in out
  assert "load_max/load_mean: mean 2.50" in out
  assert ("note: the metrics' run routed 4 experts per layer and olmoe.py:tiny has 8: its skew "
          "(the hottest expert's load over the mean) is applied as measured") in out
  assert "moejax-fssdp" in out and "no measured point on h100" in out


def test_cli_errors(capsys):
  assert cli.main(["--model", "OLMoE-1B-7B", "--cluster", "nope", "--plot", ""]) == 2
  assert "unknown cluster 'nope'" in capsys.readouterr().err
  assert cli.main(["--model", "OLMoE-1B-7B", "--gpus", "8,x", "--plot", ""]) == 2
  assert "--gpus" in capsys.readouterr().err
  assert cli.main(["--config", "configs/nope.py:tiny", "--plot", ""]) == 2
  assert "no such file" in capsys.readouterr().err


def test_cli_refuses_bad_numbers_config_files_and_metrics_in_one_line(tmp_path, capsys):
  def refused(argv, message):
    assert cli.main([*argv, "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err

  model = ["--model", "OLMoE-1B-7B", "--gpus", "8"]
  refused([*model, "--tokens-per-gpu", "nan"], "--tokens-per-gpu=nan")
  refused([*model, "--layers", "-1"], "--layers=-1")
  refused([*model, "--seq-len", "-5"], "--seq-len=-5")
  refused([*model, "--steps", "-10"], "--steps=-10")
  bad_value = tmp_path / "topk.py"
  bad_value.write_text("import configs.olmoe as o\n"
                       "def get_config(arg):\n  c = o.get_config('tiny')\n  c.moe.top_k = 99\n"
                       "  return c\n")
  refused(["--config", f"{bad_value}:tiny"], "top_k")
  (tmp_path / "none.py").write_text("x = 1\n")
  refused(["--config", str(tmp_path / "none.py")], "defines no get_config()")
  (tmp_path / "syntax.py").write_text("def get_config(:\n")
  refused(["--config", str(tmp_path / "syntax.py")], "failed to load (SyntaxError")
  (tmp_path / "list.jsonl").write_text("[1, 2]\n")
  refused([*model, "--metrics", str(tmp_path / "list.jsonl")], "list.jsonl:1: a list")
  (tmp_path / "junk.jsonl").write_text('{"step": 1}\nnot json\n')
  refused([*model, "--metrics", str(tmp_path / "junk.jsonl")], "junk.jsonl:2: not JSON")


def test_memory_per_gpu_says_what_it_counts_and_bad_paths_and_counts_are_refused(tmp_path,
                                                                                  capsys):
  """GB/GPU is the model state (no activations: it does not grow with the tokens per GPU), and
  the note says so and where the whole step's memory comes from, where it used to claim
  activations and buffers; small models read in two digits, not 0.0. Paths and counts that
  cannot be used are refused before anything is computed."""
  def memory(argv):
    assert cli.main([*argv, "--gpus", "8", "--systems", "fsdp,moejax-ep", "--plot", ""]) == 0
    out = capsys.readouterr().out
    rows = [r.split() for r in out.splitlines() if r.split()[:1] == ["8"]]
    return {r[1]: r[-1] for r in rows}, out

  tiny = ["--config", "configs/olmoe.py:tiny", "--cluster", "h100", "--steps", "2"]
  small, out = memory([*tiny, "--tokens-per-gpu", "128"])
  assert "note: GB/GPU is the state: parameters, optimizer state" in out
  assert ("python train.py --config configs/olmoe.py:tiny --memory_on_devices=N gives moejax's "
          "step whole") in out
  assert "0.27M parameters" in out.splitlines()[0]
  assert all(float(v) > 0 for v in small.values()), small
  big, _ = memory([*tiny, "--tokens-per-gpu", "4096", "--seq-len", "256"])
  assert big == small

  def refused(argv, message):
    assert cli.main([*argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and message in captured.err

  model = ["--model", "OLMoE-1B-7B", "--gpus", "8"]
  refused([*model, "--layers", "17", "--plot", ""], "--layers=17: OLMoE-1B-7B has 16 layers")
  refused([*model, "--plot", str(tmp_path / "no" / "p.png")], "--plot ")
  refused([*model, "--tokens-per-gpu", "0.5", "--plot", ""], "--tokens-per-gpu=0.5")
  refused([*model, "--gpus", "8,,16", "--plot", ""], "--gpus")
  refused([*model, "--metrics", str(tmp_path), "--plot", ""], "a directory without metrics.jsonl")
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  assert cli.main([*model, "--metrics", str(tmp_path), "--plot", "", "--layers", "2"]) == 0
