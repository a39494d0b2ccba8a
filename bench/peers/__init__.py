"""Peers side by side: the PolicyDesk workload through systems a user would pick instead of
kvmesh (transformers ``generate``, vLLM for CPU, llama.cpp), each in its own venv outside the
repository (``setup_*.sh``), driven by :mod:`bench.peers.compare`. See docs/peers.md."""
