"""peerline: a multi-GPU pipeline harness for PyTorch.

The repository's top-level folders distributed/, kernels/, launch/ and bench/ are installed as
peerline.distributed, peerline.kernels, peerline.launch and peerline.bench (see pyproject.toml).
"""

import os as _os

__version__ = "0.1.0"

# From a source checkout (no install, e.g. PYTHONPATH=<repo>), the sibling folders are this package's
# sub-packages: add the checkout root to the package path. An installed copy has them inside its own folder,
# and the signature file keeps a stray site-packages folder (dask's `distributed`) from ever being picked up.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "launch", "pipeline.py")) and _root not in __path__:
    __path__.append(_root)
