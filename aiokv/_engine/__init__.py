"""The worker's private engine: a batch, in the order it runs, and the objects that own its state.

Every module, in the order a store meets it:

- :mod:`.config`: the frozen figures every step reads, built once by the worker.
- :mod:`.request`: the record of a submitted request (its data, and lifecycle fields it does not write).
- :mod:`.tracker`: the one writer of a request's lifecycle and of result data (per-chunk codes, a
  batch's outcomes); the one place futures are settled.
- :mod:`.dispatcher`: two queues (transfers, lookups) drained into batches.
- :mod:`.pipeline`: one batch, step by step, calling the modules below in this order.
- :mod:`.slices`: every per-request or per-key loop of a batch yields to the loop within a short slice.
- :mod:`.hashing`: prompts into chunk digests.
- :mod:`.batch`: the batch (``Cycle``): its unique keys and positions, and the claims giving each store
  key one writer across overlapping batches.
- :mod:`.exists`: ``batch_exists`` (the check before the decisions, a lookup's answer, and the
  confirmation after the puts).
- :mod:`.plan`: decisions (skip present chunks, a load stops at its first hole) and the rows to move.
- :mod:`.rewrite`: keys whose reads failed, removed and put again rather than skipped.
- :mod:`.transfer`: per group, the regions, the admission of each call, the calls, the codes back.
- :mod:`.early_loads`: a load settled as soon as its own calls have returned, not at its batch's end.
- :mod:`.call_split`: a group's rows cut into backend calls within ``max_regions_per_call``.
- :mod:`.shared_reads`: a key several loads of a batch read is read once, then copied in the same call.
- :mod:`.lanes`: the threads (control, lookup, transfer) calls run on.
- :mod:`.transfer_threads`: transfer threads that admit their next call themselves.
- :mod:`.guard`: the circuit breaker in the worker (refusals on the loop, calls reported from threads).
- :mod:`.replicas`: a get that failed -800 read again from another replica inside the same call.
- :mod:`.answers`: a call's answer into per-key codes, the error it hands on, the store-pressure backoff.
- :mod:`.confirm`: keys whose puts answered success confirmed readable before any result counts them.
- :mod:`.summary`: per-chunk codes into ``StoreResult``, ``LoadResult``, a lookup's length.
"""
