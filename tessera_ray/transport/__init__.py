"""Moving pages between workers: NIXL one-sided reads, a local copy, the Ray object store."""
