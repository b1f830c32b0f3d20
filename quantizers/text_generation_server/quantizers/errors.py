"""The checkpoint error every loader raises, in a module that imports nothing heavy.

Why apart from sources.py: the launcher checks the model argument (a folder, a .gguf, the
embedded id) before it starts any rank, and catching this error must not import torch there
(seconds of every start, before the ranks even begin their own imports).
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint folder, file, tensor or key is missing or malformed."""
