"""Transport layer (I/O): the :class:`~kvxfer.transport.backend.TransferBackend` Protocol,
its NIXL implementation (the only importer of ``nixl_cu12``, imported guarded) and an
in-memory one for tests, and the ZMQ side channel (the only importer of ``zmq``)."""
