"""The NIXL transport: one-sided writes through NIXL (RDMA where its UCX has verbs). The
transport class is in `transport` (loaded by name, `base.load_transport`); the other modules
are its parts."""
