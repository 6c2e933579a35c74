"""``from layerfs.tools.main import main``: the CLI's entry point under its old name, for
../shared/device/mkbundle.sh (outside the repository). The CLI is :mod:`layerfs.cli`."""
from layerfs.cli.main import main  # noqa: F401
