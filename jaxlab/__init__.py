"""jaxlab: a JAX/XLA training and inference systems lab."""

__version__ = "0.1.0"
