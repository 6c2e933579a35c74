"""Old name of :mod:`layerfs.cli`, kept for scripts outside the repository."""
