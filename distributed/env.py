"""Who am I: rank, world size, local rank and rendezvous address, from whichever launcher started us.

Order: torchrun (RANK/WORLD_SIZE/LOCAL_RANK), Slurm srun (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), MPI (mpi4py
COMM_WORLD; OMPI_/PMI_ variables only hint that mpi4py is worth importing), else a single process. Under mpirun
with several processes but without mpi4py the job refuses (one line naming the fix) rather than run N lone copies.
"""

from __future__ import annotations

import datetime
import logging
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import _torchelastic_use_agent_store

from peerline import overrides
from peerline.distributed.config import ConfigError, ReportedElsewhere

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500
MPI_FIX = "pip install mpi4py (or pip install 'peerline[mpi]')"

_group_started = False  # set once this process has created its default process group


class RankConfigError(ConfigError):
    """A bad input only this rank sees (its GPU, its local files): every rank that raises it prints its line,
    unlike the job-wide checks every rank makes alike before any process group exists."""


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """Who this process is in the job and where the rendezvous is, as the launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | mpi | single


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[003-005,9],cpu1' -> 'gpu003' (what `scontrol show hostnames`
    prints first), without needing scontrol."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", first)
    if not m:
        return first
    prefix, ranges, suffix = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def slurm_port(job_id: str | None) -> int:
    """A port derived from the job id, so all tasks of a job agree without talking (and jobs sharing a node
    differ)."""
    if not job_id or not job_id.isdigit():
        return DEFAULT_PORT
    return 20000 + int(job_id) % 20000


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    return LaunchInfo(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
                      local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                      local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1,
                      master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)), launcher="torchrun")


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    addr = env.get("MASTER_ADDR") or first_slurm_host(nodelist)
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else slurm_port(env.get("SLURM_JOB_ID"))
    ntasks = _int(env, "SLURM_NTASKS")
    nnodes = int(env.get("SLURM_NNODES", "1") or 1)
    return LaunchInfo(rank=_int(env, "SLURM_PROCID"), world_size=ntasks,
                      local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                      local_world_size=max(1, ntasks // max(1, nnodes)),
                      master_addr=addr, master_port=port, launcher="slurm")


def _mpi_hinted(env: Mapping[str, str]) -> bool:
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))


def _mpi_size_hint(env: Mapping[str, str]) -> int:
    """The MPI job's size as the launcher's variables tell it without mpi4py (2 when only a rank > 0 says so)."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 2 if env.get("PMIX_RANK", "0").isdigit() and int(env.get("PMIX_RANK", "0")) > 0 else 1


def _from_mpi(env: Mapping[str, str]) -> LaunchInfo | None:
    try:
        from mpi4py import MPI
    except ImportError:
        size = _mpi_size_hint(env)
        if size > 1:
            raise ConfigError(f"mpirun started {size} processes but mpi4py is not installed, so each would train "
                              f"alone; {MPI_FIX}") from None
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1 and not _mpi_hinted(env):
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if comm.Get_rank() == 0:
        # Rank 0 picks a free port and tells everyone: no fixed port to collide with other jobs.
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = env.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        found = (addr, port)
    else:
        found = None
    addr, port = comm.bcast(found, root=0)
    return LaunchInfo(rank=comm.Get_rank(), world_size=comm.Get_size(), local_rank=local.Get_rank(),
                      local_world_size=local.Get_size(), master_addr=addr, master_port=port, launcher="mpi")


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Answer "who am I" from the environment (torchrun > Slurm srun > MPI > single process)."""
    env = overrides.environment() if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        # Only tasks of an srun step carry a step id: the batch script itself also has SLURM_PROCID=0 but is
        # no task of a parallel step, and runs as a single process.
        return _from_slurm(env)
    if _mpi_hinted(env):
        info = _from_mpi(env)
        if info is not None:
            return info
    return LaunchInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                      master_port=DEFAULT_PORT, launcher="single")


def launch_rank_world(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) from the launcher's variables alone, without mpi4py or a process group: for who prints
    an error or a notice, and the log prefix, before (or without) `detect_launch`."""
    env = overrides.environment() if environ is None else environ
    for rank_name, world_name in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        rank, world = env.get(rank_name, ""), env.get(world_name, "")
        if rank.isdigit() and world.isdigit():
            return int(rank), int(world)
    rank = env.get("PMIX_RANK", "")
    return (int(rank), max(2, int(rank) + 1)) if rank.isdigit() and int(rank) > 0 else (0, 1)


def group_started() -> bool:
    """Whether this process has created its default process group (an error after it may be this rank's own)."""
    return _group_started


def choose_device(requested: str, info: LaunchInfo) -> torch.device:
    """One rank per GPU, device = local rank. 'auto' falls back to the CPU when there is no GPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but CUDA is not available on this machine")
    count = torch.cuda.device_count()
    if info.local_rank >= count:
        raise RankConfigError(f"local rank {info.local_rank} has no GPU: this node has {count} GPU(s); start at most "
                          f"{count} ranks per node")
    return torch.device("cuda", info.local_rank)


def attempt_store(info: LaunchInfo, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of `tcp://MASTER_ADDR:MASTER_PORT`, its keys under a prefix of this launcher attempt.

    torchrun shares its own store with the workers (with --master_port, --rdzv-endpoint and --standalone alike) and
    keeps it across `--max-restarts` attempts: without the prefix, a restarted attempt reads the dead attempt's
    gloo / NCCL addresses and fails in `connectFullMesh ... Connection refused`. A store that rank 0 hosts
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, plain launchers) is new in every attempt and takes no attempt prefix:
    agents restarted for a failure and for a membership change count their restarts differently, so their ranks
    would otherwise meet under different prefixes and wait for each other in vain."""
    store = _open_store(info, timeout)
    store.set_timeout(timeout)
    prefix = "peerline"
    if _torchelastic_use_agent_store():
        prefix += f"/attempt{overrides.get('TORCHELASTIC_RESTART_COUNT') or '0'}"
    prefixed = dist.PrefixStore(prefix, store)
    await_ranks(prefixed, info, timeout.total_seconds())
    return prefixed


def _open_store(info: LaunchInfo, timeout: datetime.timedelta) -> dist.Store:
    """torch's tcp:// store, except that rank 0's server does not wait for the others (`await_ranks` does, and
    names who is missing); a rank that cannot reach the store in time is one line naming rank 0."""
    host = not _torchelastic_use_agent_store() and info.rank == 0  # else torchrun's agent hosts it
    try:
        return dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=host, timeout=timeout,
                             wait_for_workers=False, multi_tenant=host)
    except (RuntimeError, TimeoutError) as exc:  # DistNetworkError, DistStoreError
        hosted = "torchrun's agent" if not host and _torchelastic_use_agent_store() else "rank 0"
        raise RankConfigError(f"rank {info.rank} could not reach the rendezvous at {info.master_addr}:"
                              f"{info.master_port} within {timeout.total_seconds():.0f} s: {hosted}, which hosts "
                              f"it, is not up ({type(exc).__name__})") from None


def await_ranks(store: dist.Store, info: LaunchInfo, timeout_s: float) -> None:
    """Every rank checks in under `peerline/arrived/<rank>` and waits for all the others; past `timeout_s` the
    lowest rank present prints one line naming the ranks that never came (the others exit quietly)."""
    store.set(f"peerline/arrived/{info.rank}", "1")
    keys = [f"peerline/arrived/{r}" for r in range(info.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return
    except (RuntimeError, TimeoutError):
        pass
    missing = [r for r, key in enumerate(keys) if not store.check([key])]
    if not missing:
        return
    present = [r for r in range(info.world_size) if r not in missing]
    line = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {info.world_size} did not "
            f"reach the rendezvous at {info.master_addr}:{info.master_port} within {timeout_s:.0f} s (rank "
            f"{', '.join(map(str, present))} did); check that every rank was started and can reach that address")
    raise (RankConfigError if info.rank == min(present) else ReportedElsewhere)(line)


def init_distributed(info: LaunchInfo, device: torch.device, timeout_s: float) -> None:
    """Create the default process group (NCCL on GPUs, gloo on the CPU); nothing for a single process.

    The group's timeout is a little longer than --timeout-s, so peerline's own watchdog (one line naming what a
    rank waited for) fires before NCCL's multi-line abort."""
    if info.world_size == 1 or dist.is_initialized():
        return
    global _group_started
    backend = "nccl" if device.type == "cuda" else "gloo"
    _group_started = True
    overrides.set_default("MASTER_ADDR", info.master_addr)
    overrides.set_default("MASTER_PORT", str(info.master_port))
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL init, bound to our GPU
    timeout = datetime.timedelta(seconds=timeout_s + max(5.0, 0.1 * timeout_s))
    dist.init_process_group(backend=backend, store=attempt_store(info, timeout), rank=info.rank,
                            world_size=info.world_size, timeout=timeout, **kwargs)
    log.info("rank %d/%d up (%s, %s, device %s)", info.rank, info.world_size, info.launcher, backend, device)
