"""Export a peerline checkpoint as a plain state_dict of the whole model, for use outside peerline.

  python -m peerline.launch.export_checkpoint DIR --to model.pt            torch.save of {name: tensor}
  python -m peerline.launch.export_checkpoint DIR --to model.safetensors   safetensors (the `safetensors` package)

DIR is a --save folder (its newest checkpoint that verifies) or one `iter_NNNNNN` folder in it. The keys are the
whole model's (`layers.17.fc1.weight`): a module whose `layers` is an nn.Sequential of the model's layers loads
the file with `load_state_dict`. Only the model is exported, not the optimizer or RNG state, except that a
checkpoint of `--precision master` over bf16 parameters exports each weight's fp32 master (`optim.<name>.master`)
in place of its bf16 rounding. The checkpoint's files
are checked against its manifest first, and its metadata is read by the restricted unpickler (resilience/dcp_io.py),
which is why this does not call torch's `format_utils.dcp_to_torch_save`: that one unpickles `.metadata` with plain
pickle and copies the optimizer state too. Bad input: one `peerline: error:` line, exit 2 (a missing or foreign
DIR, a checkpoint that does not verify, a --to that cannot be written or has a suffix other than .pt, .pth or
.safetensors, a bad flag). A --to that is a character device or FIFO is written into (torch.save's format unless
its name ends in .safetensors), never replaced.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.observe.record import check_file
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as store
from peerline.distributed.resilience import dcp_io
from peerline.distributed.resilience.checkpoint_names import MASTER, MODEL, OPTIM
from peerline.files import WRITTEN_INTO, atomic_write, special_kind

#: --to's suffixes and the format each is written in.
FORMATS = {".pt": "torch", ".pth": "torch", ".safetensors": "safetensors"}


def newest_verified(root: Path) -> Path:
    """The checkpoint folder to export: `root` itself when it is one (`iter_NNNNNN`), else its newest that
    verifies."""
    if not root.is_dir():
        raise ckpt.CheckpointError(f"{root} is a file, not a checkpoint directory" if root.exists() else
                                   f"checkpoint directory {root} does not exist")
    it = ckpt.folder_iteration(root)
    if it is not None:
        ckpt.verify_files(root.parent, it)
        return root
    if not store.iterations(root):
        raise ckpt.CheckpointError(f"{root} is not a checkpoint directory: it holds no iter_NNNNNN folder")
    reasons = []
    for it in store.iterations(root):
        problem = store.verify(root, it, 0, {})
        if problem is None:
            return ckpt.iteration_dir(root, it)
        reasons.append(problem[1])
    raise ckpt.CheckpointError(f"no checkpoint in {root} verifies (the newest: {reasons[0]})")


def model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a verified checkpoint folder, by whole-model name, on the CPU."""
    try:
        specs = dcp_io.tensor_specs(dcp_io.read_metadata(folder))
        state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items() if k.startswith(MODEL)}
        sources = {k: _master_of(k) if _master_of(k) in specs else k for k in state}  # master AdamW: fp32 weights
        state.update({k: torch.empty(specs[src][0], dtype=specs[src][1]) for k, src in sources.items() if src != k})
        dcp_io.load({sources[k]: v for k, v in state.items()}, folder)
    except Exception as exc:  # noqa: BLE001 - any reader failure of a verified folder means the same: one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ckpt.CheckpointError(f"checkpoint {folder} cannot be read: {type(exc).__name__}: {first}") from None
    if not state:
        raise ckpt.CheckpointError(f"checkpoint {folder} holds no model tensors")
    return {k[len(MODEL):]: v for k, v in state.items()}


def _master_of(model_key: str) -> str:
    """The checkpoint key of a model tensor's fp32 master (`optim.<name>.master`; master AdamW's checkpoints)."""
    return f"{OPTIM}{model_key[len(MODEL):]}.{MASTER}"


def target_format(target: Path) -> str:
    """The format of --to by its suffix ('torch' or 'safetensors'), once it is known to be writable; a character
    device or FIFO without a known suffix takes torch.save's. Else one-line ConfigError."""
    check_file("--to", target)
    if target.suffix in FORMATS:
        return FORMATS[target.suffix]
    if special_kind(target) in WRITTEN_INTO:
        return "torch"
    raise ConfigError(f"--to {target}: unknown suffix {target.suffix or '(none)'!r}; give a file name ending in "
                      f"{', '.join(FORMATS)}")


def export(source: str | Path, target: str | Path) -> Path:
    """Write the model of `source`'s checkpoint to `target` (.safetensors: safetensors; else torch.save)."""
    target = Path(target)
    kind = target_format(target)  # before the checkpoint is read: a bad --to costs nothing
    folder = newest_verified(Path(source))
    state = model_state(folder)
    if kind == "safetensors":
        try:
            from safetensors.torch import save as to_bytes
        except ImportError:
            raise ckpt.CheckpointError("--to *.safetensors needs the safetensors package (pip install "
                                       "safetensors); or export to a .pt file") from None
        data = to_bytes({k: v.contiguous() for k, v in state.items()})
        atomic_write(target, lambda f: f.write(data))
    else:
        atomic_write(target, lambda f: torch.save(state, f))
    return folder


class Parser(argparse.ArgumentParser):
    """A bad flag is one `peerline: error:` line, exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"peerline: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m peerline.launch.export_checkpoint",
                    description="Export a peerline checkpoint's model as a plain state_dict.")
    parser.add_argument("checkpoint", metavar="DIR", help="a --save folder (its newest checkpoint that verifies) "
                        "or one iter_NNNNNN folder")
    parser.add_argument("--to", required=True, metavar="FILE", help="model.pt or .pth (torch.save) or "
                        "model.safetensors; a character device or FIFO is written into (torch.save's format)")
    args = parser.parse_args(argv)
    try:
        folder = export(args.checkpoint, args.to)
    except (ConfigError, OSError) as exc:
        print(f"peerline: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    print(f"peerline: exported the model of {folder} to {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
