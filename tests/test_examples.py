"""The generation example / ``specla-generate`` command line: a smoke run per drafter kind, and bad
input refused with one ``error:`` line and exit status 2 before anything is loaded."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import tiny_model
from tiny_lm import tiny_lm

from specla_compile import cli
from specla_compile.runtime.drafters import EagleConfig, EagleHead

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "generate.py"
# Small and fast: an untrained embedded model, a short prompt, few tokens, no inner compiler.
FAST = ["--train-steps", "0", "--prompt", "Twinkle, twinkle, little star", "--max-new-tokens", "6", "--inner", "eager"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A byte-vocabulary Llama drafter, an EAGLE head for the embedded model (without and with a token
    ranking), and a Qwen3.5 target saved without tokenizer files."""
    root = tmp_path_factory.mktemp("checkpoints")
    tiny_lm(vocab=256, seed=1).save_pretrained(root / "drafter")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(cli.embedded_model(steps=0)))
    head.save_pretrained(root / "eagle")
    head.set_token_ranking(torch.randperm(head.config.vocab_size))
    head.save_pretrained(root / "eagle_ranked")
    tiny_model("qwen3_5", layers=2).save_pretrained(root / "qwen_no_tokenizer")
    return root


def run_script(argv: list[str], monkeypatch) -> None:
    """Run examples/generate.py as ``__main__`` in this process (the package import is paid once)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.mark.parametrize(
    "drafter, shape",
    [
        ("ngram", ["--mode", "tree"]),
        ("model:{root}/drafter", ["--mode", "chain", "--depth", "3"]),
        ("eagle:{root}/eagle", ["--mode", "tree", "--depth", "2", "--budget", "4"]),
        ("eagle:{root}/eagle_ranked", ["--mode", "tree", "--depth", "2", "--budget", "4", "--draft-vocab", "64"]),
        ("eagle:{root}/eagle", ["--mode", "chain", "--depth", "3", "--quantize", "int8"]),
        ("eagle:{root}/eagle", ["--mode", "chain", "--depth", "3", "--quantize", "none"]),
    ],
)
def test_generate_runs_with_each_drafter(drafter, shape, checkpoints, tmp_path, monkeypatch, capsys):
    stats_file = tmp_path / "stats.json"
    run_script([*FAST, *shape, "--drafter", drafter.format(root=checkpoints), "--json", str(stats_file)], monkeypatch)
    stats = json.loads(stats_file.read_text())
    assert stats["identical"] is True
    assert stats["new_tokens"] == 6
    assert 1 <= stats["target_passes"] <= 6
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["tokens_per_second"] > 0
    out = capsys.readouterr().out
    assert "greedy output identical to plain decoding: True" in out
    assert "one speculative pass cost" in out and ("on a CPU" in out) == (not torch.cuda.is_available())


def test_speed_explanation_warns_when_acceptance_does_not_pay_off():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    low = cli.explain_speed(tokens_per_pass=1.2, spec_pass_seconds=0.02, plain_pass_seconds=0.01, device=gpu)
    assert "speedup about 1.20 / 2.00 = 0.60x" in low[0] and low[-1].startswith("warning: acceptance too low")
    high = cli.explain_speed(tokens_per_pass=3.0, spec_pass_seconds=0.02, plain_pass_seconds=0.01, device=cpu)
    assert len(high) == 2 and "on a CPU" in high[1]


def bad_inputs(root: Path) -> list[tuple[list[str], str]]:
    """(arguments, a fragment of the one error line they must give)."""
    missing, qwen = str(root / "nonexistent"), str(root / "qwen_no_tokenizer")
    return [
        (["--model", missing], f"--model {missing!r} does not exist"),
        (["--drafter", f"model:{missing}"], "does not exist"),
        (["--drafter", f"eagle:{missing}"], "does not exist"),
        (["--model", str(root)], "has no config.json"),
        (["--drafter", "bogus"], "--drafter must be"),
        (["--drafter", "model:"], "--drafter must be"),
        (["--depth", "0"], "--depth must be >= 1"),
        (["--budget", "-1"], "--budget must be >= 1"),
        (["--top-k", "0"], "--tree-top-k must be >= 1"),
        (["--tree-top-k", "-3"], "--tree-top-k must be >= 1"),
        (["--tau", "-1"], "--tau must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--train-steps", "-1"], "--train-steps must be >= 0"),
        (["--do-sample", "--temperature", "0"], "temperature must be > 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--sample-top-k", "-2"], "top_k must be >= 0"),
        (["--prompt", ""], "--prompt is empty"),
        (["--draft-vocab", "8"], "--draft-vocab needs --drafter eagle:PATH"),
        (["--quantize", "int8"], "--quantize needs --drafter eagle:PATH"),
        (["--quantize", "int4"], "argument --quantize: invalid choice"),
        (["--drafter", f"eagle:{root / 'eagle'}", "--draft-vocab", "8"], "has no token ranking"),
        (["--drafter", f"eagle:{root / 'eagle_ranked'}", "--draft-vocab", "0"], "--draft-vocab must be >= 1"),
        (["--inner", "bogus"], "argument --inner: invalid choice"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--device", "bogus"], "--device 'bogus'"),
        (["--depth", "four"], "argument --depth: invalid int value"),
        (["--json", str(root / "no_such_dir" / "stats.json")], "its directory does not exist"),
        (["--model", qwen, "--tokenizer", missing], "is not a directory"),
        (["--tokenizer", "bytes"], "--tokenizer needs --model"),
        (["--model", qwen], "pass --tokenizer PATH"),
        (["--model", qwen, "--tokenizer", str(root / "drafter")], "has no tokenizer files"),
    ] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "CUDA is not available")])


def test_bad_input_is_refused_before_loading(checkpoints, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(cli, "load", no_loading)
    for argv, fragment in bad_inputs(checkpoints):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, argv
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, (argv, err)


def test_good_edge_values_pass_the_checks(checkpoints):
    parser = cli.build_parser()
    for argv in (
        ["--temperature", "0"],  # greedy: the temperature is not used
        ["--do-sample", "--top-p", "1.0", "--sample-top-k", "0"],
        ["--model", str(checkpoints / "qwen_no_tokenizer"), "--tokenizer", "bytes"],
        ["--drafter", f"model:{checkpoints / 'drafter'}", "--tau", "0"],
    ):
        cli.check_args(parser, parser.parse_args(argv))  # raises SystemExit on a refusal


def subprocess_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, not an installed copy
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, env=env, timeout=120)


def test_help_documents_every_option_with_its_default_and_no_warning():
    result = subprocess_run(str(SCRIPT), "--help")
    assert result.returncode == 0
    assert result.stderr == ""  # no Triton (or other) warning
    options = [a for a in cli.build_parser()._actions if a.option_strings and a.dest != "help"]
    text = " ".join(result.stdout.split())
    for action in options:
        assert action.option_strings[0] in text
    assert text.count("(default: ") == len(options)


@pytest.mark.parametrize("entry", [[str(SCRIPT)], ["-m", "specla_compile"]])
def test_command_line_error_is_one_line_and_exit_2(entry, tmp_path):
    result = subprocess_run(*entry, "--model", str(tmp_path / "nonexistent"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: --model") and "does not exist" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_console_script_and_type_marker_are_packaged():
    import importlib

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, name = project["project"]["scripts"]["specla-generate"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["specla_compile"]
    assert (ROOT / "specla_compile" / "py.typed").is_file()
