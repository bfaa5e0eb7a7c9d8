"""Step 5, at the moment a transfer thread is free for a call: which of its rows still go (the
tracker's per-call go-ahead for each request the call carries), and the call cut down to them.
Rows of requests cancelled, timed out or finished while the call waited are dropped, so their
memory is never touched; a call left with no row is not made at all."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import IntArray
from .call_split import Call, GroupRows
from .request import Request
from .tracker import RequestTracker


@dataclass(slots=True)
class Admission:
    """A call as it starts: the call cut to the rows that go (None: no row goes), the requests
    :meth:`RequestTracker.begin_call` counted in (to count out when it returns), and the rows dropped
    (indices into the group's rows)."""

    call: Call | None
    requests: list[Request]
    dropped_rows: IntArray


def admit(call: Call, rows: GroupRows, tracker: RequestTracker) -> Admission:
    """Ask the tracker about every request of ``call`` (each once) and cut the call to those going."""
    plan_of_row = rows.plan_of_row[call.rows]
    plan_indices = np.unique(plan_of_row)
    requests = [rows.plan[j].request for j in plan_indices.tolist()]
    going = np.array(tracker.begin_call(requests), dtype=bool)
    if going.all():  # the usual case: nothing to cut
        return Admission(call, requests, np.zeros(0, dtype=np.int64))
    admitted = [r for r, ok in zip(requests, going.tolist(), strict=True) if ok]
    keep = np.isin(plan_of_row, plan_indices[going])
    dropped = call.rows[~keep]
    if not admitted:
        return Admission(None, [], dropped)
    index = np.flatnonzero(keep)
    cut = Call(call.op, call.rows[index], call.keys[index], call.addrs[index], call.sizes[index])
    return Admission(cut, admitted, dropped)
