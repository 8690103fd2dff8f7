"""`--model gpt` and user LMs on token data, multi-process on the CPU (gloo) against a single-process run.

A tiny GPT (2 blocks, hidden 64, 4 heads, seq 32, vocab 512) on a small folder of text tokenized once into a
module-wide cache: pp=2 (both schedules), dp=2, pp=2 x dp=2, tied embeddings and recomputation each equal the
single-process run of the same model, data and seed within 1e-5 (losses and every layer's parameter checksums).
"""

from __future__ import annotations

import math
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import assert_same_run, cpu_env, forkrun_cmd, run_job

pytestmark = pytest.mark.timeout(300)

MODELS = str(Path(__file__).resolve().parent / "models")
STDLIB_FILES = ("textwrap.py", "string.py", "argparse.py", "json/encoder.py")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict[str, Path]:
    """A small text folder (four stdlib files, about 150 KB) and a token cache shared by the module's runs."""
    root = tmp_path_factory.mktemp("text")
    folder = root / "corpus"
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        shutil.copy(stdlib / name, folder / name.replace("/", "_"))
    return {"data": folder, "cache": root / "cache"}


def gpt_args(text: dict[str, Path], m: int, *extra: str) -> list[str]:
    return ["--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "512",
            "--data", str(text["data"]), "--data-cache", str(text["cache"]), "--micro-batch-size", "2",
            "--iters", "3", "-m", str(m), *extra]


def run_ok(launcher: list[str], args: list[str], tmp_path: Path, name: str) -> dict:
    proc, res = run_job(launcher, args, tmp_path, name, env=cpu_env(PYTHONPATH=MODELS))
    assert proc.returncode == 0, proc.stderr
    return res


@pytest.fixture(scope="module")
def reference(text, tmp_path_factory) -> dict[str, dict]:
    """Single-process runs: M=4 and M=8 (the dp=2 runs' global batch), and M=4 with tied embeddings."""
    tmp = tmp_path_factory.mktemp("ref")
    refs = {f"m{m}": run_ok([sys.executable], gpt_args(text, m), tmp, f"m{m}") for m in (4, 8)}
    refs["tied"] = run_ok([sys.executable], gpt_args(text, 4, "--tie-embeddings"), tmp, "tied")
    return refs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_pp2_equals_single_process(text, reference, tmp_path, schedule):
    res = run_ok(forkrun_cmd(2), gpt_args(text, 4, "--pp", "2", "--schedule", schedule), tmp_path, "pp2")
    assert_same_run(res, reference["m4"])
    assert res["losses"][-1] < res["losses"][0] and res["ppl"][0] == pytest.approx(math.exp(res["losses"][0]))


def test_gpt_dp2_equals_single_process(text, reference, tmp_path):
    res = run_ok(forkrun_cmd(2), gpt_args(text, 4, "--pp", "1", "--dp", "2"), tmp_path, "dp2")
    assert_same_run(res, reference["m8"])
    assert {k.split("/")[0] for k in res["layer_checksums"]} == {"r0", "r1"}


def test_gpt_pp2_dp2_equals_single_process(text, reference, tmp_path):
    res = run_ok(forkrun_cmd(4), gpt_args(text, 4, "--pp", "2", "--dp", "2", "--tie-embeddings"), tmp_path, "g4")
    assert_same_run(res, run_ok([sys.executable], gpt_args(text, 8, "--tie-embeddings"), tmp_path, "tied8"))


def test_tied_embeddings_pp2_equal_pp1(text, reference, tmp_path):
    res = run_ok(forkrun_cmd(2), gpt_args(text, 4, "--pp", "2", "--tie-embeddings"), tmp_path, "tied2")
    assert_same_run(res, reference["tied"])
    # Tying changes the run: the head starts as the embedding and both take the summed gradient.
    assert res["layer_checksums"]["r0/0"] != reference["m4"]["layer_checksums"]["r0/0"]


def test_recompute_equals_without(text, reference, tmp_path):
    full = run_ok([sys.executable], gpt_args(text, 4, "--recompute", "full"), tmp_path, "full")
    assert_same_run(full, reference["m4"])
    first = run_ok(forkrun_cmd(2), gpt_args(text, 4, "--pp", "2", "--recompute", "1"), tmp_path, "first1")
    assert_same_run(first, reference["m4"])


@pytest.mark.parametrize("factory", ["embedding_lm", "embedding_lm_builders"])
def test_user_embedding_model_on_text_pp2_equals_pp1(text, tmp_path, factory):
    args = [*gpt_args(text, 4)[2:], "--model", f"lm_models:{factory}"]
    one = run_ok([sys.executable], args, tmp_path, "one")
    two = run_ok(forkrun_cmd(2), [*args, "--pp", "2"], tmp_path, "two")
    assert_same_run(two, one)
    assert one["config"]["loss"] == "cross-entropy" and one["tflops"] == [None] * 3


@pytest.mark.parametrize("memory", ["fast", "1f1b"])
@pytest.mark.parametrize("schedule", [("zb-h1",), ("zbv", "--stages", "2"), ("zb-interleaved", "--stages", "2")])
def test_fused_linear_model_zero_bubble_equals_pp1(text, tmp_path, schedule, memory):
    """FusedLinear's own autograd path on the CPU (a GPU run's path): its weights hold most of each stage's
    parameters, so B takes split_backward's lean form (the graph freed after B, W the queued weight GEMMs); with
    either --zb-memory order."""
    args = [*gpt_args(text, 4)[2:], "--model", "lm_models:fused_mlp_lm"]
    one = run_ok([sys.executable], args, tmp_path, "one")
    two = run_ok(forkrun_cmd(2), [*args, "--pp", "2", "--schedule", *schedule, "--zb-memory", memory], tmp_path,
                 "two")
    assert_same_run(two, one)
    assert two["losses"][-1] < two["losses"][0]


def test_fused_linear_model_zero_bubble_with_replicas_equals_one_process(text, tmp_path):
    """The lean weight pass with dp=2: the fused weights' all-reduce hooks run in W, the other parameters' in B;
    pp=2 x dp=2 with M=4 per replica equals one process with M=8."""
    args = [*gpt_args(text, 4)[2:], "--model", "lm_models:fused_mlp_lm"]
    one = run_ok([sys.executable], [*args, "-m", "8"], tmp_path, "one")
    grid = run_ok(forkrun_cmd(4), [*args, "--pp", "2", "--dp", "2", "--schedule", "zb-h1"], tmp_path, "grid")
    assert_same_run(grid, one)


@pytest.mark.slow
def test_default_gpt_learns_the_default_corpus(tmp_path):
    """The default corpus (the stdlib, tokenized into a fresh cache): the loss starts near log(vocab) and falls
    well below it within 40 iterations."""
    args = ["--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--micro-batch-size",
            "8", "-m", "2", "--iters", "40", "--lr", "3e-3", "--log-every", "10", "--data-cache", str(tmp_path / "c")]
    res = run_ok([sys.executable], args, tmp_path, "learn")
    log_vocab = math.log(4096)
    assert res["config"]["data"] == "text" and len(res["losses"]) == 4
    assert res["losses"][-1] < log_vocab - 1.0, res["losses"]
