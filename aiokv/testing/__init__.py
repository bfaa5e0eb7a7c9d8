"""Test doubles for aiokv: a backend wrapper that fails, delays or holds calls on cue and records every
call it saw, and a toy paged KV cache to move real bytes with.

Like httpx's ``MockTransport``, this ships with aiokv so that aiokv's own tests and yours can drive a
:class:`~aiokv.KVWorker` through the failures a real store produces, without a real store::

    import threading

    from aiokv import Code, KVWorker, MemoryBackend
    from aiokv.testing import FaultInjectingBackend, FaultRule

    release = threading.Event()
    backend = FaultInjectingBackend(
        MemoryBackend(),
        rules=[
            FaultRule(op="put", per_key=True, probability=0.1, code=Code.TRANSFER_FAILED),  # ~10% of keys
            FaultRule(op="get", keys=lambda key: key.endswith(bad_hash), code=Code.NOT_FOUND),
            FaultRule(op="exists", times=1, exception=ConnectionError),  # the first exists raises
            FaultRule(op="put", hang=release),  # puts block until release.set() (30 s at most)
        ],
        seed=1,
    )
    async with KVWorker(layout, backend, namespace="model", chunk_tokens=256) as worker:
        ...
    written = backend.sent_keys("put")  # keys that reached the MemoryBackend's batch_put

How a rule applies to a call:

- ``op`` picks the calls: ``"exists"``, ``"put"``, ``"get"``, ``"register"`` or ``"*"`` (the three data
  calls). ``keys`` picks the keys it targets: ``None`` (all), a collection of keys, or a predicate. A
  call with no targeted key is left alone.
- The rule *fires* with ``probability``, at most ``times`` times (``None``: no limit). With
  ``per_key=False`` (the default) it draws once per call and fires for all the call's targeted keys;
  with ``per_key=True`` each targeted key draws on its own and ``times`` counts keys.
- When it fires: ``delay_s`` sleeps (``time.sleep``, which releases the GIL, as a native store does);
  ``hang`` waits on a :class:`threading.Event` until it is set or ``max_hang_s`` passes (then
  :class:`HangExpiredError` is raised, so a forgotten event fails a test instead of hanging it);
  ``exception`` is raised before the inner backend is called (nothing is stored or read); ``code`` is
  answered for the fired keys, which are *not* passed to the inner backend, so their bytes are never
  touched, while the other keys go through. On ``exists`` a fired key answers ``False``.
- Every rule is consulted for every call, in order: delays add up, the first exception wins, and a
  key gets the code of the first rule that fired on it.

Random draws come from one ``random.Random(seed)``, so a run is reproducible for a given order of
calls (with several executor threads that order can vary; use ``probability=1.0`` with ``keys`` or
``times`` where a test needs exact faults). Rules whose probability is 1 consume no randomness.

:class:`BlockingBackend` is the common special case: every call of one op blocks until ``release()``.

Besides rules, a test can hold calls and watch them start::

    with backend.blocked("put"):          # puts wait, once entered, until the block ends
        future = worker.store(tokens, block_ids)
        backend.entered("put").wait(10)   # a threading.Event, set when a put starts
        ...                               # the worker is inside a put: check what must hold now
    backend.count("put"), backend.keys_seen("put"), backend.calls_of("put")[0].addrs

Ops are named alike everywhere (rules, records, :meth:`~FaultInjectingBackend.block`,
:meth:`~FaultInjectingBackend.count`): ``"register"``, ``"unregister"``, ``"exists"``, ``"put"``,
``"get"``, ``"close"``.

:class:`PagedCache` / :class:`GroupCache` are a toy engine KV cache (NumPy regions of blocks with their
:class:`~aiokv.KVLayout`); :func:`chunk_value` and :func:`same_blocks` check the bytes a worker moved.

Imported on demand (they need more than aiokv does): :mod:`aiokv.testing.tiny_model` writes small,
seeded random-weight checkpoints (a Llama, a DeepSeek-style MLA model) for vLLM engines, and
:mod:`aiokv.testing.cluster` builds a Mooncake cluster in network namespaces.
"""

from __future__ import annotations

from .blocking import BlockingBackend
from .faults import OPS, FaultInjectingBackend
from .paged_cache import SENTINEL, GroupCache, PagedCache, chunk_block_ids, chunk_value, same_blocks
from .records import Call
from .rules import DATA_OPS, FaultRule, HangExpiredError, InjectedFault

__all__ = [
    "DATA_OPS",
    "OPS",
    "SENTINEL",
    "BlockingBackend",
    "Call",
    "FaultInjectingBackend",
    "FaultRule",
    "GroupCache",
    "HangExpiredError",
    "InjectedFault",
    "PagedCache",
    "chunk_block_ids",
    "chunk_value",
    "same_blocks",
]
