"""The read path: a layer's blob file served chunk by chunk (chunk states, the fetch core,
fail-fast, prefetch policy, access traces and their replay, local blob files, the chunk
cache).

Modules: ``accesstraces``, ``blobfiles``, ``chunkstates``, ``failfast``, ``fetcher``,
``localblobs``, ``prefetch``, ``tracereplay``, ``chunkcache``, ``chunkfile``."""
