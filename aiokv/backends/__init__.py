"""Backends: one module per store, all behind the protocol in :mod:`aiokv.backends.base`."""
