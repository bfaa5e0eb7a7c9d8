"""The connector's worker side: runs in each vLLM worker process (one per TP/PP rank).

:class:`~.connector_worker.WorkerSide` moves the chunks the scheduler ordered between the engine's KV
cache and the store, through the chunk movers of :mod:`.chunk_movers` (aiokv's workers, or this rank's
host tier, :mod:`.tier_worker`), measures loads and forwards for the load policy (:mod:`.load_meter`),
and reports back in the worker metadata.
"""
