"""The compiled check of meta images (layerfs/formats/erofscheck.py), built
with warnings as errors only when ``CI=true`` is in the build's environment;
everything else about the package is in pyproject.toml."""

import os

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra"] + (["-Werror"] if os.environ.get("CI") == "true" else [])

setup(ext_modules=[Extension("layerfs.formats._erofscheck", ["layerfs/formats/_erofscheck.c"],
                             extra_compile_args=["-O2", *WARNINGS])])
