"""nemo_jq: post-training reasoning LLMs on the J_Q loss continuum.

Importing the package is light: submodules load their heavy dependencies themselves.
"""

from importlib import metadata

try:
    __version__ = metadata.version("nemo-jq")  # pyproject.toml's, the one place it is written
except metadata.PackageNotFoundError:  # a source tree on the import path, not installed
    __version__ = "unknown"
