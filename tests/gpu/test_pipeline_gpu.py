"""The whole pipeline on GPUs (launch/pipeline.py --json) against single-GPU runs of the same model and seed:
graph == eager, --stages 2, peerline vs torch kernels, pp=2 over both schedules and both transports (copy engine
with lanes, split or decoupled flags; NCCL), dp=2, the README's default command, and the MPI integration tests
under NCCL.

Tolerances: fp32 (TF32 is off for matmuls by default in torch) runs the same kernels on the same shapes per stage,
so pp=2 matches one GPU to 1e-5 relative, and dp=2 (gradients summed in another order) too; on one GPU graph and
--stages 2 match eager to 1e-6 and peerline's kernels match torch's to 1e-4. bf16 defaults: 2e-2 (8 mantissa bits;
peerline never rounds dW to bf16, torch's autograd accumulation does).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run, gpu_env, outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TINY = ("--hidden", "256", "--layers", "4", "--seq", "64", "--micro-batch-size", "2", "--iters", "5",
        "--warmup-iters", "2")
FP32 = (*TINY, "--dtype", "fp32")
REF4 = Run("ref4", (*FP32, "--no-graph", "-m", "4"))
REF8 = Run("ref8", (*FP32, "--no-graph", "-m", "8"))
DEFAULT1 = Run("default1", ("--iters", "6"))  # the README's command: bf16, graphs, peerline kernels

# check -> (run, reference, rtol), all on one GPU
ONE_GPU = {
    "graph_vs_eager": (Run("g1", (*FP32, "--graph", "-m", "4")), REF4, 1e-6),
    "stages2_eager_vs_one_stage": (Run("s2", (*FP32, "--stages", "2", "-m", "4", "--no-graph")), REF4, 1e-6),
    "stages2_graph_vs_one_stage": (Run("s2g", (*FP32, "--stages", "2", "-m", "4", "--graph")), REF4, 1e-6),
    "torch_kernels_vs_peerline_kernels": (Run("t1", (*FP32, "--no-graph", "-m", "4", "--kernels", "torch")), REF4,
                                          1e-4),
    "default_bf16_peerline_vs_torch_kernels": (DEFAULT1, Run("default1_torch", ("--iters", "6", "--kernels", "torch")),
                                               2e-2),
}

# pp=2 (fp32, M=4) flags -> the run against REF4 at 1e-5
PP2 = {
    "1f1b-nccl-graph": ("--schedule", "1f1b", "--p2p", "nccl", "--graph"),
    "1f1b-copy-engine-graph": ("--schedule", "1f1b", "--p2p", "copy-engine", "--graph"),
    "gpipe-copy-engine-graph": ("--schedule", "gpipe", "--p2p", "copy-engine", "--graph"),
    "gpipe-nccl-graph": ("--schedule", "gpipe", "--p2p", "nccl", "--graph"),
    "gpipe-nccl-no-graph": ("--schedule", "gpipe", "--p2p", "nccl", "--no-graph"),
    "1f1b-copy-engine-graph-split": ("--schedule", "1f1b", "--p2p", "copy-engine", "--graph", "--p2p-split"),
    "1f1b-copy-engine-no-graph-split": ("--schedule", "1f1b", "--p2p", "copy-engine", "--no-graph", "--p2p-split"),
    "gpipe-copy-engine-no-graph-1-lane": ("--schedule", "gpipe", "--p2p", "copy-engine", "--no-graph", "--p2p-lanes",
                                          "1"),
    "1f1b-copy-engine-graph-decoupled": ("--schedule", "1f1b", "--p2p", "copy-engine", "--graph", "--p2p-decoupled",
                                         "--p2p-lanes", "3"),
}
# The tiny model's 64 KiB messages are split too (by default only messages of 1 MiB and more are).
SPLIT_ALL = (("PEERLINE_P2P_SPLIT_MIN", "0"),)


def graph_flag(args: tuple[str, ...]) -> bool | None:
    """The graph state a run's flags ask for (None: the default, graphs on a GPU)."""
    return True if "--graph" in args else False if "--no-graph" in args else None


@pytest.mark.parametrize("check", list(ONE_GPU))
def test_one_gpu(pipeline_runs, check: str) -> None:
    got_run, ref_run, rtol = ONE_GPU[check]
    got, ref = pipeline_runs.results(got_run, ref_run)
    assert_matches(got, ref, Expect(rtol, graph=graph_flag(got_run.args)))


@pytest.mark.gpu2
@pytest.mark.parametrize("combo", list(PP2))
def test_pp2_matches_one_gpu(pipeline_runs, combo: str) -> None:
    flags = PP2[combo]
    r = Run(f"pp2_{combo}", (*FP32, "--pp", "2", "-m", "4", *flags), nproc=2, env=SPLIT_ALL)
    got, ref = pipeline_runs.results(r, REF4)
    transport = flags[flags.index("--p2p") + 1]
    assert_matches(got, ref, Expect(1e-5, world=2, graph=graph_flag(flags), transport=transport))


@pytest.mark.gpu2
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
def test_dp2_matches_one_gpu_with_twice_the_microbatches(pipeline_runs, graph: str) -> None:
    r = Run(f"dp2{graph.replace('--', '_').replace('-', '_')}", (*FP32, "--pp", "1", "--dp", "2", graph, "-m", "4"),
            nproc=2)
    got, ref = pipeline_runs.results(r, REF8)
    assert_matches(got, ref, Expect(1e-5, world=2, dp=2, graph=graph == "--graph"))


@pytest.mark.gpu2
def test_readme_default_on_two_gpus(pipeline_runs) -> None:
    got, ref = pipeline_runs.results(Run("default2", ("--iters", "6"), nproc=2), DEFAULT1)
    assert_matches(got, ref, Expect(2e-2, world=2, graph=True, transport="copy-engine"))


@pytest.mark.gpu2
@pytest.mark.timeout(300)
def test_mpi_integration_under_nccl(gpu_out) -> None:
    """tests/integration under `mpirun -n 2` with pytest-mpi: NCCL on this machine (gloo in CI)."""
    missing = [m for m in ("mpi4py", "pytest_mpi") if importlib.util.find_spec(m) is None]
    if shutil.which("mpirun") is None or missing:
        pytest.skip(f"needs mpirun, mpi4py and pytest-mpi (missing: {missing or 'mpirun'})")
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
           "tests/integration"]
    rc, tail = run(cmd, gpu_out / "mpi_integration.log", 240, gpu_env())
    assert rc == 0, outcome("mpirun -n 2 pytest --with-mpi tests/integration", rc, tail, 240)
