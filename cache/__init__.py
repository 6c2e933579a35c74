"""The node's block cache of chunks (content addressed, bounded, LRU)."""
