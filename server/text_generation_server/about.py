"""The package's version and the id of the model it ships.

`text_generation_server` is a namespace package whose portions live in three folders
(server/, quantizers/, kernels/), so it has no `__init__.py` of its own to hold these;
pyproject.toml reads the version from here.
"""

__version__ = "0.1.0"

# The short id of the model shipped in server/text_generation_server/assets/, accepted
# wherever a model folder is.
EMBEDDED_MODEL_ID = "tiny-pycoder"
