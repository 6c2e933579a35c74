"""layerfs: image and layer storage for agent sandboxes.

The shared core: formats, manifests, store client, names. The builder, the
node cache and the command line live in the subpackages ``layerfs.builder``,
``layerfs.node.reads`` and ``layerfs.cli``.
"""

__version__ = "0.1.0"
