"""torch.distributed.checkpoint (DCP) reading and writing for peerline's checkpoints, without unpickling code.

A checkpoint folder holds DCP's files: `__<rank>_<n>.distcp` (the tensors each rank wrote; a tensor replicated over
data-parallel ranks is written once, by DCP's default save planner) and `.metadata` (which tensor lives where, with
its global shape and dtype). Saving and loading use DCP's default planners and FileSystemWriter / FileSystemReader,
so any grid can load any other grid's checkpoint by names.

`.metadata` is a pickle written by DCP; torch's FileSystemReader loads it with `pickle.load`, which would run any
callable a tampered file names. `SafeReader` loads it instead with an unpickler that resolves only DCP's metadata
classes, torch.Size, torch dtypes and paths (the "restricting globals" pattern of Python's pickle documentation;
torch's weights_only unpickler refuses DCP's protocol-4 frames), and the caller checks its SHA-256 against the
manifest first. The tensors themselves are read by DCP with `torch.load(..., weights_only=True)`. Only tensors are
stored: scalars and strings go into the JSON manifest, never into DCP's pickled byte entries.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from peerline.distributed.resilience.checkpoint_names import METADATA

__all__ = [
    "CheckpointException", "METADATA", "SafeReader", "load", "read_metadata", "save", "tensor_shapes", "tensor_specs",
]

#: (module, name) pairs `.metadata` may name: plain data classes and values, nothing callable with side effects.
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # read, never used as a path
    ("collections", "OrderedDict"): dict,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only `_ALLOWED` names and torch dtypes; anything else is an UnpicklingError."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(folder: str | os.PathLike) -> dcp_metadata.Metadata:
    """DCP's `.metadata` of `folder`, unpickled with the restricted unpickler (raises on anything else)."""
    with open(Path(folder) / METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata comes from the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def tensor_specs(metadata: dcp_metadata.Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every stored tensor's name, global shape and dtype."""
    return {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, dcp_metadata.TensorStorageMetadata)}


def tensor_shapes(metadata: dcp_metadata.Metadata) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's name and global shape."""
    return {k: shape for k, (shape, _) in tensor_specs(metadata).items()}


def _alone() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save(state: Mapping[str, torch.Tensor], folder: str | os.PathLike, process_group: Any = None) -> None:
    """Write `state` (this rank's tensors by global name) into `folder` with DCP; collective over every rank of
    `process_group` (default: the default group; one process: no group needed). Files are fsynced by the writer.
    Tensors all on the host (a staged copy) take DCP's serial loader: its overlapping one would synchronize the
    calling thread's current CUDA stream."""
    on_host = {"per_thread_copy_ahead": 0} if all(t.device.type == "cpu" for t in state.values()) else {}
    writer = FileSystemWriter(folder, sync_files=True, overwrite=True, **on_host)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on single-process use and on overwriting
        dcp.save(dict(state), storage_writer=writer, process_group=process_group,
                 no_dist=process_group is None and _alone())


def load(state: dict[str, torch.Tensor], folder: str | os.PathLike) -> None:
    """Fill `state`'s tensors in place from the DCP checkpoint in `folder` (collective, like `save`). Every key
    must be in the checkpoint (the caller checks names and shapes first)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeReader(folder), no_dist=_alone())
