"""OCI images in and out: image sources (registries, layouts, archives), the
image model they share, import into layers and envs, and export."""
