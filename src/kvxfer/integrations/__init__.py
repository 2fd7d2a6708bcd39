"""Engine adapters built on kvxfer's engine, each optional (its engine is imported only
inside its own subpackage): :mod:`kvxfer.integrations.vllm`."""
