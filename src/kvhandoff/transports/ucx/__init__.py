"""The UCX transport (ucx-py): tag-matched sends and receives over UCX lanes. The transport
class is in `transport` (loaded by name, `base.load_transport`); the other modules are its
parts."""
