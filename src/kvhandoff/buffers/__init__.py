"""buffers — the memory a handoff moves: per-(region, layer) buffer sets and their byte views,
the page pool, the shared-memory allocator (the shm transport's map lane), and the checksums of
landed bytes (xxh3 on host memory, devsum where the buffer lives)."""
