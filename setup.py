"""Package list for the three source folders mapped into one namespace.

pyproject.toml maps server/, quantizers/ and kernels/ onto text_generation_server;
setuptools cannot discover packages through such a mapping, so they are listed here.
"""
from setuptools import find_packages, setup

ROOTS = {
    "text_generation_server": "server",
    "text_generation_server.quantizers": "quantizers",
    "text_generation_server.kernels": "kernels",
}


def _packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages())
