"""Glue between aiokv and serving engines; each engine's package imports that engine lazily."""
