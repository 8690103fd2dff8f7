"""peerline: a multi-GPU pipeline harness for PyTorch.

The repository's top-level folders distributed/, kernels/ and launch/ are installed as
peerline.distributed, peerline.kernels and peerline.launch (see pyproject.toml).
"""

__version__ = "0.1.0"
