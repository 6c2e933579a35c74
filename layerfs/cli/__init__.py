"""The ``layerfs`` command line: one module per command group."""
