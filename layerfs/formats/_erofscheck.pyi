"""The structural check of a meta image, compiled (layerfs/formats/_erofscheck.c)."""

def check(image: bytes | memoryview, blob_size: int,
          chunk_size: int) -> tuple[int, int, int, int, int] | None: ...
