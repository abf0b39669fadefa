"""nemo_jq: post-training reasoning LLMs on the J_Q loss continuum.

Importing the package is light: submodules load their heavy dependencies themselves.
"""

__version__ = "0.1.0"
