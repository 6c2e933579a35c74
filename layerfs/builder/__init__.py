"""Turns a source (directory or tar stream) into a layer in the store."""
