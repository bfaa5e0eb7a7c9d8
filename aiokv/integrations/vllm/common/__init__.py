"""Shared data of the vLLM connector: what both the scheduler's process and every worker's use.

The connector's settings (:mod:`.connector_config`), the engine's geometry (:mod:`.geometry`, built
from vLLM's objects by :mod:`.from_vllm` and :mod:`.state_geometry`), keys from vLLM's block hashes
(:mod:`.block_keys`), the step metadata passed between the sides (:mod:`.wire`), and the pieces each
side runs over its own backend: the backend handles (:mod:`.backend_handles`), one aiokv worker per KV
cache group (:mod:`.group_workers`), the counters reported to vLLM (:mod:`.stats_reporter`,
:mod:`.connector_stats`). Nothing here imports either side.
"""
