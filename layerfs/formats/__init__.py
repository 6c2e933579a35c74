"""On-disk formats: EROFS images and the layer chunk table."""
