"""The same-host shm transport: one-sided writes into the peer's memory (map, cma and CUDA IPC
lanes), with the two-sided path where writes are off. The transport class is
in `transport` (loaded by name, `base.load_transport`); the other modules are its parts."""
