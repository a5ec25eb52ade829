"""Peer implementations measured side by side with jaxlab in the same benchmark run.

Each peer is a standalone script run by *another* Python (one that has the peer's
framework installed), so jaxlab's own environment never needs PyTorch.
"""
