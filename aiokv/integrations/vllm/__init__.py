"""aiokv as a vLLM KV connector: ``kv_connector_module_path: "aiokv.integrations.vllm"``,
``kv_connector: "AiokvConnector"`` (docs/vllm.md). vLLM is imported only when the connector is."""

from __future__ import annotations

from typing import Any

__all__ = ["AiokvConnector"]


def __getattr__(name: str) -> Any:
    if name == "AiokvConnector":
        from .connector import AiokvConnector

        return AiokvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
