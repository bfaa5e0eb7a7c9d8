"""The connector's scheduler side: runs in vLLM's scheduler (engine core) process.

:class:`~.connector_scheduler.SchedulerSide` answers vLLM's lookups without blocking the scheduler
(:mod:`.group_lookups`, the host tier's index :mod:`.tier_index`), decides which hits to load
(:mod:`.load_policy`), which chunks each step stores (:mod:`.step_stores`, :mod:`.prompt_tails`,
:mod:`.state_groups`), and sends its decisions to the workers in the step's metadata.
"""
