"""The command line: config keys (ambiguity, did-you-mean, HF names, deprecated alias), --print-config without
torch, an ``Example`` in every entry point's --help, and run_eval.sh's rerun after a failed start."""
import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from config.run_config import DEFAULT, ConfigError, apply_overrides, format_config

REPO = Path(__file__).resolve().parent.parent


def _err(words) -> str:
    with pytest.raises(ConfigError) as e:
        apply_overrides(DEFAULT, words)
    return str(e.value)


def test_bare_key_of_two_sections_is_an_error_naming_both():
    msg = _err(["top_k=5"])
    assert "ambiguous" in msg and "tree.top_k" in msg and "gen.top_k" in msg
    cfg = apply_overrides(DEFAULT, ["tree.top_k=7", "gen.top_k=5"])
    assert (cfg.tree.top_k, cfg.gen.top_k) == (7, 5)
    assert DEFAULT.tree.top_k == 10 and DEFAULT.gen.top_k == 0  # the default is untouched


def test_deprecated_top_k_sampling_alias_still_sets_sampling_top_k():
    for key in ("top_k_sampling", "gen.top_k_sampling"):
        cfg = apply_overrides(DEFAULT, [f"{key}=9"])
        assert cfg.gen.top_k == 9 and cfg.gen.top_k_sampling == 9 and cfg.tree.top_k == DEFAULT.tree.top_k


def test_typos_get_a_did_you_mean_not_a_wall_of_keys():
    msg = _err(["max_new_token=5"])
    assert "did you mean max_new_tokens" in msg
    assert "gen.max_new_tokens" not in msg  # one suggestion per field
    assert len(msg) < 200 and "tree.expand_subseq_token" not in msg
    assert "did you mean gen.top_k" in _err(["gen.topk=3"])
    assert "did you mean temperature" in _err(["temprature=1"])
    assert "did you mean" not in _err(["zzzzzz=1"])
    assert "expected int" in _err(["max_new_tokens=many"])


def test_python_runconfig_refuses_a_typo_or_a_wrong_type_in_one_line():
    from config.run_config import RunConfig
    cfg = RunConfig()
    with pytest.raises(ConfigError, match=r"no setting gen\.max_new_token; did you mean gen\.max_new_tokens\?"):
        cfg.gen.max_new_token = 5
    with pytest.raises(ConfigError, match=r"gen\.max_new_tokens='x' must be int, not str"):
        cfg.gen.max_new_tokens = "x"
    with pytest.raises(ConfigError, match=r"tree\.expand_levels=True must be int, not bool"):
        cfg.tree.expand_levels = True
    with pytest.raises(ConfigError, match="did you mean model"):
        cfg.modle = None
    for bad in ("cfg.gen = 3", "cfg.emu.time_scale = '2'"):
        with pytest.raises(ConfigError):
            exec(bad)
    cfg.gen.temperature = 1                        # an int for a float field is taken, as a float
    cfg.gen.top_k_sampling = 4                     # a property with a setter stays settable
    assert cfg.gen.temperature == 1.0 and isinstance(cfg.gen.temperature, float) and cfg.gen.top_k == 4
    assert apply_overrides(DEFAULT, {"temperature": 1, "tree.expand_levels": 3}).gen.temperature == 1.0
    with pytest.raises(ConfigError, match="must be int"):
        apply_overrides(DEFAULT, {"max_new_tokens": 2.5})


def test_usage_lines_name_the_command_typed():
    from config.invocation import prog
    assert prog("pipeline.tools.eval", "/venv/bin/flowspec-eval", "") == "flowspec-eval"      # a console script
    assert prog("pipeline.tools.eval", "/repo/pipeline/tools/eval.py", "") == "python -m pipeline.tools.eval"
    assert prog("pipeline.tools.eval", "eval.py", "pipeline.tools.eval=./run_eval.sh") == "./run_eval.sh"
    assert prog("pipeline.run", "run.py", "pipeline.tools.eval=./run_eval.sh") == "python -m pipeline.run"  # a child
    for script, usage in (("run_eval.sh", "usage: ./run_eval.sh"), ("run_pipe.sh", "usage: ./run_pipe.sh")):
        r = subprocess.run([str(REPO / script), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(usage), (script, r.stdout[:200])


def test_run_tests_sh_runs_the_paths_given_and_a_fast_tier():
    import os

    def words(*argv):
        r = subprocess.run([str(REPO / "run_tests.sh"), *argv], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, RUN_TESTS_DRY_RUN="1"), cwd=REPO)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()
    assert words() == ["tests"]                                           # everything (CI)
    assert words("tests/test_sampling.py") == ["tests/test_sampling.py"]  # just that file, not the whole suite
    assert words("tests/test_tree.py::test_reroot", "-x") == ["tests/test_tree.py::test_reroot", "-x"]
    assert words("--fast") == ["-m", "not slow", "tests"]
    assert words("-k", "draft") == ["-k", "draft", "tests"]               # an option's value is no path
    from tests.conftest import is_slow
    assert is_slow("test_e2e.py", "test_x") and is_slow("test_new_file.py", "test_x")   # new files: full tier
    assert not is_slow("test_tree.py", "test_x") and is_slow("test_drafter_bench.py", "test_bench_on_stories260k")


def test_flowspec_is_an_alias_of_continuous():
    from config.modes import canonical_mode
    assert apply_overrides(DEFAULT, ["mode=flowspec"]).gen.mode == "continuous"
    assert canonical_mode("FlowSpec") == "continuous" and canonical_mode("naive") == "naive"
    assert "not valid" in _err(["mode=flowspeed"])


def test_hf_sampling_names():
    cfg = apply_overrides(DEFAULT, ["temperature=0.8", "do_sample=false"])  # place does not matter
    assert cfg.gen.temperature == 0.0
    cfg = apply_overrides(DEFAULT, ["do_sample=true", "temperature=0.7", "gen.top_k=40", "top_p=0.9"])
    assert (cfg.gen.temperature, cfg.gen.top_k, cfg.gen.top_p) == (0.7, 40, 0.9)
    assert "temperature" in _err(["do_sample=true"])
    assert "true/false" in _err(["do_sample=maybe"])
    for word in ("repetition_penalty=1.1", "gen.repetition_penalty=1.2"):
        assert "repetition_penalty is not implemented" in _err([word])
    # stop strings (HF's stop_strings): one string, or a JSON list; a malformed list is one line
    assert apply_overrides(DEFAULT, ["stop=###"]).gen.stop_strings() == ["###"]
    assert apply_overrides(DEFAULT, ['gen.stop=["a,b", "END"]']).gen.stop_strings() == ["a,b", "END"]
    assert "JSON list" in _err(["stop=[oops"]) and "non-empty strings" in _err(['stop=["", 3]'])


def test_format_config_marks_non_defaults():
    text = format_config(apply_overrides(DEFAULT, ["mode=naive", "tree.init_depth=4"]))
    lines = text.splitlines()
    assert "gen.mode = 'naive'   # default: 'continuous'" in lines
    assert "tree.init_depth = 4   # default: 6" in lines
    assert "gen.top_k = 0" in lines and "tree.top_k = 10" in lines
    assert sum("# default:" in l for l in lines) == 2


def test_print_config_runs_standalone_without_torch():
    code = ("import sys; from pipeline.run import main; rc = main(['--print-config', 'mode=naive', "
            "'gen.top_k=5']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "gen.mode = 'naive'   # default: 'continuous'" in res.stdout
    assert "gen.top_k = 5   # default: 0" in res.stdout
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--print-config", "top_k=5"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().count("\n") == 0 and "tree.top_k" in res.stderr and "gen.top_k" in res.stderr


def test_run_pipe_print_config_does_not_launch():
    res = subprocess.run(["bash", "run_pipe.sh", "--print-config", "mode=pruned"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "gen.mode = 'pruned'" in res.stdout and "[rank" not in res.stderr


ENTRY_POINTS = ["pipeline.run", "pipeline.tools.bench", "pipeline.tools.eval", "pipeline.tools.simulate", "pipeline.tools.timeline",
                "pipeline.tools.profile", "pipeline.tools.quant_report", "split_and_save_models", "draft.train_eagle",
                "data.prepare", "pipeline.tools.hf_generate", "pipeline.tools.layerbench",
                "pipeline.tools.graphbench", "pipeline.tools.fuzz"]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_help_has_an_example(module):
    import importlib
    mod = importlib.import_module(module)
    buf = io.StringIO()
    with redirect_stdout(buf), pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    text = buf.getvalue()
    assert "Example" in text, f"{module} --help has no example"
    assert "usage:" in text
    flat = " ".join(text.split())
    assert "(default: None)" not in flat and "] (default:" not in flat and "(default: )" not in flat, \
        f"{module} --help shows a default twice or a meaningless one"


# -- run_eval.sh: a failed start leaves no meta.json --------------------------------------------------------
def _eval(tmp_path, data_dir, *extra):
    from pipeline.tools.eval import main
    return main(["--datasets", "mt_bench", "--modes", "ar", "--temperatures", "0", "--begin", "0", "--end", "1",
                 "--first-turn-only", "--profile", "none", "--world", "2", "--stage-dir", str(tmp_path / "stages"),
                 "--out-dir", str(tmp_path / "out"), "--data-dir", str(data_dir), "--no-plots", "--quiet", *extra])


def test_eval_rerun_after_a_failed_start(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # every generation the corrected command asks for is already there, so it launches nothing
    row = {"dataset": "mt_bench", "question_id": 7, "turn": 0, "mode": "ar", "temperature": 0.0, "new_tokens": 3,
           "decode_s": 0.5, "accept_lengths": [1, 1, 1], "prompt_ids": [1, 2], "output_ids": [5, 6, 2], "tau": 1.0}
    (out / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert _eval(tmp_path, tmp_path / "nowhere", "--max-new-tokens", "16") == 2
    assert "dataset 'mt_bench' is missing" in capsys.readouterr().err
    assert not (out / "meta.json").exists(), "a failed start wrote meta.json"
    assert _eval(tmp_path, tmp_path / "nowhere", "--max-new-tokens", "16", "max_new_token=3") == 2
    assert not (out / "meta.json").exists()
    data = tmp_path / "data" / "mt_bench"
    data.mkdir(parents=True)
    (data / "question.jsonl").write_text(json.dumps({"question_id": 7, "turns": ["hello"]}) + "\n")
    # the corrected rerun (other data dir, another max_new_tokens) is accepted, not "another configuration"
    assert _eval(tmp_path, data.parent, "--max-new-tokens", "32") == 0
    err = capsys.readouterr().err
    assert "another configuration" not in err and "nothing to run" in err
    assert json.loads((out / "meta.json").read_text())["max_new_tokens"] == 32
    # a really different configuration is still refused afterwards
    assert _eval(tmp_path, data.parent, "--max-new-tokens", "64") == 2
    assert "another configuration" in capsys.readouterr().err


def test_eval_resume_across_the_default_draft_change(tmp_path, capsys):
    """A meta.json from before ``draft_sources`` was recorded ran with the head alone: resuming it under today's
    default (eagle,lookup) with the same overrides is refused (rows of two drafters would mix)."""
    from pipeline.tools.eval import draft_sources
    assert draft_sources([]) == "eagle,lookup" and draft_sources([], "eagle") == "eagle"
    assert draft_sources(["draft.sources=eagle, lookup", "draft.sources="]) == "eagle"
    out, data = tmp_path / "out", tmp_path / "data" / "mt_bench"
    out.mkdir()
    data.mkdir(parents=True)
    (data / "question.jsonl").write_text(json.dumps({"question_id": 7, "turns": ["hello"]}) + "\n")
    row = {"dataset": "mt_bench", "question_id": 7, "turn": 0, "mode": "ar", "temperature": 0.0, "new_tokens": 3,
           "decode_s": 0.5, "accept_lengths": [1, 1, 1], "prompt_ids": [1, 2], "output_ids": [5, 6, 2], "tau": 1.0}
    (out / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert _eval(tmp_path, data.parent, "--max-new-tokens", "32") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta.pop("draft_sources") == "eagle,lookup"
    assert _eval(tmp_path, data.parent, "--max-new-tokens", "32") == 0          # the same configuration resumes
    capsys.readouterr()
    (out / "meta.json").write_text(json.dumps(meta))                  # as written before the key existed
    assert _eval(tmp_path, data.parent, "--max-new-tokens", "32") == 2
    err = capsys.readouterr().err
    assert "draft_sources: 'eagle' vs 'eagle,lookup'" in err and "overrides:" not in err


# -- the GPU-host goal: scripts/gpu_goals.sh and pipeline.tools.hf_generate fail in one line ----------------
def test_gpu_goals_help_and_no_cuda(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)}
    h = subprocess.run(["bash", "scripts/gpu_goals.sh", "--help"], cwd=REPO, capture_output=True, text=True, env=env,
                       timeout=60)
    assert h.returncode == 0 and "Example" in h.stdout and "set -uo" not in h.stdout
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-GPU message is not reachable")
    r = subprocess.run(["bash", "scripts/gpu_goals.sh", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("gpu_goals: no "), r.stderr


def test_hf_generate_bad_input_is_one_line(tmp_path, capsys):
    from pipeline.tools.hf_generate import main
    out = str(tmp_path / "o.jsonl")
    assert main(["--output", out]) == 2
    assert capsys.readouterr().err.strip() == "error: give --prompts-file FILE or --prompt-ids (one of the two)"
    assert main(["--output", out, "--prompt-ids", "1,x"]) == 2
    assert capsys.readouterr().err.strip() == "error: --prompt-ids takes comma-separated integers"
    assert main(["--output", out, "--prompt-ids", "1,2", f"model.stage_dir={tmp_path}"]) == 2
    assert "has no manifest.json" in capsys.readouterr().err


def test_bench_hf_generate_refuses_an_emulated_testbed(capsys):
    from pipeline.tools.bench import main
    assert main(["--hf-generate", "--prompt-ids", "1,2", "emu.profile=edge_orin_7b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --hf-generate times real HF generate") and "emu.profile=edge_orin_7b" in err


# -- scripts/gpu_head_recipe.sh: help, bad steps and missing inputs are one line each ---------------------
def test_gpu_head_recipe_help_and_errors(tmp_path):
    script = ["bash", "scripts/gpu_head_recipe.sh"]
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)}
    h = subprocess.run(script + ["--help"], cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert h.returncode == 0 and "Example" in h.stdout and "set -euo" not in h.stdout
    bad = subprocess.run(script + ["bogus"], cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("gpu_head_recipe: give a step")
    for step, what in (("train", "run the data step first"), ("eval", "run the train step first")):
        r = subprocess.run(script + [step, str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                           env={**env, "DEVICE": "cpu"}, timeout=120)
        if "no " in r.stderr and "question.jsonl" in r.stderr:
            pytest.skip("the six evaluation sets are not beside the checkout (../shared/data)")
        assert r.returncode == 2 and what in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_run_tests_sh_reruns_a_few_failures_once_and_names_them(tmp_path):
    """A test that fails in the full run and passes alone is named FLAKY and the run passes; one that fails again
    fails the run (planted: a test that always fails), and so does a flake with the rerun off. The rerun keeps the
    options given (here ``-k``, which the flaky test reads: a rerun that dropped it would fail again)."""
    import os
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pathlib\n"
                     f"MARK = pathlib.Path({str(tmp_path / 'ran')!r})\n"
                     "def test_flaky(pytestconfig):\n"
                     "    first = not MARK.exists(); MARK.touch()\n"
                     "    assert not first, 'a first run fails'\n"
                     "    assert 'flaky' in pytestconfig.getoption('keyword'), 'the rerun lost -k'\n"
                     "def test_fine():\n"
                     "    pass\n"
                     "def test_broken():\n"
                     "    assert False, 'every run fails'\n")

    def run(select, **env):
        (tmp_path / "ran").unlink(missing_ok=True)
        return subprocess.run([str(REPO / "run_tests.sh"), f"{probe}::{select}" if select else str(probe),
                               "-p", "no:cacheprovider", "-k", "flaky or fine or broken"], capture_output=True,
                              text=True, timeout=300, cwd=REPO,
                              env={**{k: v for k, v in os.environ.items()     # not the outer run's settings
                                      if k not in ("FLOWSPEC_NO_RERUN", "FLOWSPEC_TEST_WORKERS")}, **env})
    r = run("test_flaky")
    assert r.returncode == 0 and "[tests] FLAKY (failed in the full run, passed alone): " in r.stderr, r.stderr
    assert "test_probe.py::test_flaky" in r.stderr.splitlines()[-1]
    r = run("")     # the broken test fails again alone: the run fails, and it is not called flaky
    assert r.returncode == 1 and "running them once more" in r.stderr and "FLAKY" not in r.stderr, r.stderr
    r = run("test_flaky", FLOWSPEC_NO_RERUN="1")
    assert r.returncode == 1 and "once more" not in r.stderr, r.stderr
