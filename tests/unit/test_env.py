"""Launcher detection from faked environments."""

import pytest

from peerline.distributed.config import ConfigError
from peerline.distributed.env import detect_launch, first_slurm_host, slurm_port


def test_torchrun():
    info = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                          "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port, info.launcher) == \
        (3, 4, 1, "node7", 1234, "torchrun")


def test_torchrun_wins_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_ID": "0"}
    assert detect_launch(env).launcher == "torchrun"


def test_slurm_srun_task():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_NNODES": "4", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[003-006]"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 2)
    assert info.master_addr == "gpu003" and info.master_port == slurm_port("4242") and info.launcher == "slurm"


def test_slurm_batch_script_alone_is_a_single_process():
    # The batch script has SLURM_PROCID=0 but no step: it is no task of a parallel step.
    info = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"})
    assert info.launcher == "single" and info.world_size == 1


def test_slurm_master_addr_override():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "3000", "SLURM_JOB_NODELIST": "a1"}
    info = detect_launch(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 3000)


@pytest.mark.parametrize("nodelist,first", [("gpu[003-005,9],cpu1", "gpu003"), ("a1,b2", "a1"), ("node", "node"),
                                            ("n[1-2]-ib", "n1-ib")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_port_is_stable_and_in_range():
    assert slurm_port("123456") == slurm_port("123456")
    assert 20000 <= slurm_port("123456") < 40000
    assert slurm_port(None) == 29500


def test_single_process():
    info = detect_launch({})
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "single")


def test_bad_integer_is_a_clear_error():
    with pytest.raises(ConfigError, match="RANK"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})


def test_mpi_hint_without_mpi_world_falls_back(monkeypatch):
    # A lone process with an OMPI variable but mpi4py reporting one rank and... still a valid single-rank answer.
    info = detect_launch({"OMPI_COMM_WORLD_SIZE": "1"})
    assert info.world_size == 1


def test_process_environment_is_the_default(monkeypatch):
    # No mapping given: the process environment, read through peerline/overrides.py.
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = detect_launch()
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (1, 2, 1, "torchrun")


@pytest.mark.parametrize("agent_store, prefix", [("True", "peerline/attempt2/"), (None, "peerline/")])
def test_store_keys_carry_the_attempt_only_in_torchruns_shared_store(monkeypatch, agent_store, prefix):
    """torchrun's shared agent store outlives an attempt: keys under the restart count. A store rank 0 hosts is
    new in every attempt, and agents restarted for a failure and for a membership change count differently: no
    attempt in its keys, or the restarted ranks would wait for each other under different prefixes."""
    import datetime

    import torch.distributed as dist

    from peerline.distributed.env import LaunchInfo, attempt_store
    from tests.ports import free_port

    port = free_port()
    outside = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)  # torchrun's agent
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    if agent_store:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    else:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        outside = None  # rank 0 hosts the store itself
    info = LaunchInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                      master_port=port, launcher="torchrun")
    store = attempt_store(info, datetime.timedelta(seconds=10))
    raw = outside or dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=10))
    assert raw.check([f"{prefix}peerline/arrived/0"])
    assert store.get("peerline/arrived/0") == b"1"
