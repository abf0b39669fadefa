"""nemo_jq: post-training reasoning LLMs on the J_Q loss continuum.

Importing the package is light: submodules load their heavy dependencies themselves.
"""

from importlib import metadata

from nemo_jq import _moved

_moved.install()  # 0.2's flat module paths (nemo_jq.trainer, ...) still import, with a DeprecationWarning

try:
    __version__ = metadata.version("nemo-jq")  # pyproject.toml's, the one place it is written
except metadata.PackageNotFoundError:  # a source tree on the import path, not installed
    __version__ = "unknown"
