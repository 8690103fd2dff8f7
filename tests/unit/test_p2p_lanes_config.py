"""--p2p-lanes / --p2p-split reach RunConfig and are checked; RankStreams carries the extra lanes (CPU: none)."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.streams import create_rank_streams
from peerline.launch.cli import build_parser, config_from_args

pytestmark = pytest.mark.timeout(30)


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_defaults_two_lanes_round_robin() -> None:
    cfg = parse()
    assert cfg.p2p_lanes == 2 and cfg.p2p_split is False


def test_flags_reach_the_config() -> None:
    cfg = parse("--p2p-lanes", "4", "--p2p-split")
    assert cfg.p2p_lanes == 4 and cfg.p2p_split is True
    assert parse("--p2p-lanes", "1").p2p_lanes == 1


@pytest.mark.parametrize("argv", [("--p2p-lanes", "0"), ("--p2p-lanes", "3", "--p2p-split"),
                                  ("--p2p-lanes", "1", "--p2p-split")])
def test_bad_lane_counts_fail_with_one_line(argv: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="--p2p-lanes"):
        parse(*argv)


def test_cpu_streams_have_no_lanes_and_bad_counts_fail() -> None:
    s = create_rank_streams(torch.device("cpu"), p2p_lanes=3)
    assert s.p2p_lanes == [] and "p2p" in s.roles()
    with pytest.raises(ValueError, match="p2p_lanes"):
        create_rank_streams(torch.device("cpu"), p2p_lanes=0)


def test_allreduce_priority_flag() -> None:
    from peerline.distributed.config import RunConfig

    assert RunConfig().allreduce_priority == "highest"
    cfg = config_from_args(build_parser().parse_args(["--allreduce-priority", "normal"]))
    assert cfg.allreduce_priority == "normal"
    with pytest.raises(ConfigError, match="unknown allreduce priority 'urgent'; choose one of highest, normal"):
        RunConfig(allreduce_priority="urgent")
    with pytest.raises(ValueError, match="allreduce_priority must be highest or normal"):
        create_rank_streams(torch.device("cpu"), allreduce_priority="urgent")


def test_nccl_max_ctas_default_and_zero() -> None:
    from peerline.distributed.assemble import dp_group_options
    from peerline.distributed.config import RunConfig

    assert RunConfig().nccl_max_ctas == 16  # measured default (config.py says where)
    cfg = config_from_args(build_parser().parse_args(["--nccl-max-ctas", "0"]))
    assert cfg.nccl_max_ctas == 0 and dp_group_options(cfg) is None  # 0: NCCL's default, no options
    with pytest.raises(ConfigError, match="--nccl-max-ctas must be in 0..64"):
        RunConfig(nccl_max_ctas=65)
