"""Export a peerline checkpoint as a plain state_dict of the whole model, for use outside peerline.

  python -m peerline.launch.export_checkpoint DIR --to model.pt            torch.save of {name: tensor}
  python -m peerline.launch.export_checkpoint DIR --to model.safetensors   safetensors (the `safetensors` package)

DIR is a --save folder (its newest checkpoint that verifies) or one `iter_NNNNNN` folder in it. The keys are the
whole model's (`layers.17.fc1.weight`): a module whose `layers` is an nn.Sequential of the model's layers loads
the file with `load_state_dict`. Only the model is exported, not the optimizer or RNG state. The checkpoint's files
are checked against its manifest first, and its metadata is read by the restricted unpickler (resilience/dcp_io.py),
which is why this does not call torch's `format_utils.dcp_to_torch_save`: that one unpickles `.metadata` with plain
pickle and copies the optimizer state too. Bad input: one `peerline: error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as store
from peerline.distributed.resilience import dcp_io
from peerline.distributed.resilience.checkpoint_names import MODEL
from peerline.files import atomic_write


def newest_verified(root: Path) -> Path:
    """The checkpoint folder to export: `root` itself when it is one, else its newest that verifies."""
    if root.name.startswith("iter_") and (root / ckpt.MANIFEST).exists():
        it = int(root.name[len("iter_"):])
        ckpt.verify_files(root.parent, it)
        return root
    if not root.is_dir():
        raise ckpt.CheckpointError(f"checkpoint directory {root} does not exist")
    for it in store.iterations(root):
        if store.verify(root, it, 0, {}) is None:
            return ckpt.iteration_dir(root, it)
    raise ckpt.CheckpointError(f"no checkpoint in {root} verifies")


def model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a verified checkpoint folder, by whole-model name, on the CPU."""
    specs = dcp_io.tensor_specs(dcp_io.read_metadata(folder))
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items() if k.startswith(MODEL)}
    dcp_io.load(state, folder)
    return {k[len(MODEL):]: v for k, v in state.items()}


def export(source: str | Path, target: str | Path) -> Path:
    """Write the model of `source`'s checkpoint to `target` (.safetensors: safetensors; else torch.save)."""
    folder = newest_verified(Path(source))
    state = model_state(folder)
    target = Path(target)
    if target.suffix == ".safetensors":
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peerline.launch.export_checkpoint",
                                     description="Export a peerline checkpoint's model as a plain state_dict.")
    parser.add_argument("checkpoint", metavar="DIR", help="a --save folder (its newest checkpoint that verifies) "
                        "or one iter_NNNNNN folder")
    parser.add_argument("--to", required=True, metavar="FILE", help="model.pt (torch.save) or model.safetensors")
    args = parser.parse_args(argv)
    try:
        folder = export(args.checkpoint, args.to)
    except (ckpt.CheckpointError, OSError) as exc:
        print(f"peerline: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    print(f"peerline: exported the model of {folder} to {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
