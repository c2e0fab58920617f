"""runtime — the threads and I/O around the sans-IO session: the `TransferAgent` (construction
and public API), the engine handles, the control loop that drives the session (ZMQ, timers,
peer calls, hashing), the device-event waiter, the bootstrap registration and route lookups,
and the Prometheus metrics."""
