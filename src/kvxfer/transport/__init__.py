"""Transport layer (I/O): the NIXL backend (the only importer of ``nixl_cu12``) and the
ZMQ side channel (the only importer of ``zmq``)."""
