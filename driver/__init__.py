"""Kubernetes DRA driver for GPUs, FPGAs and NICs."""

__version__ = "0.1.0"
