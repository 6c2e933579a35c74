"""The read path: a layer's blob file served chunk by chunk, from memory, the
chunk cache or the store (the symptom: a slow or failing read).

- ``blobfiles``: lazy blob files, a layer's data blob read through its chunk table
- ``chunkstates``: where each chunk is on the node; the one fetch of each in flight
- ``fetcher``: the fetch core, getting chunk bytes from the store for reads that missed
- ``failfast``: which store reads fail at once after a failure, and until when
- ``prefetch``: the prefetch policies, which chunks to fetch before a reader asks
- ``libraryahead``: the libraries a program that missed names, and theirs, fetched ahead
- ``accesstraces``: the order in which sandboxes first touched a layer's chunks
- ``tracereplay``: replaying those traces while a sandbox comes up
- ``localblobs``: a small layer's blob, whole and verified, on the node's disk
- ``partialblobs``: a large layer's blob on the node's disk, filled as the kernel reads it
- ``chunkcache``: the node's chunk cache (content addressed, bounded, LRU, crash safe)
- ``chunkfile``: the layout of one cache file, and checking what is read from it
"""
