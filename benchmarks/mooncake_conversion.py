"""How fast the Mooncake binding converts each argument form, for one large batch.

The binding converts ``all_buffer_ptrs``/``all_sizes`` while holding the GIL, before it releases it for
the transfer, so this time stalls every other thread (the event loop included). The conversion alone is
timed by passing one key with the full region lists: the binding converts every argument, then answers
-600 for the length mismatch without doing anything else.

Needs a master, which it starts itself; run it inside a private network namespace:
    unshare -rn sh -c 'ip link set lo up && python -m benchmarks mooncake-conversion'
Usage: python -m benchmarks mooncake-conversion [--keys 2312] [--regions 96] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from aiokv.backends.base import RegionTable
from aiokv.backends.mooncake import MooncakeBackend
from aiokv.backends.mooncake_calls import region_lists
from aiokv.backends.mooncake_master import MooncakeMaster

REGION_BYTES = 64  # small, so that the real batch of 2,312 x 96 regions fits a modest segment


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm-up: first-touch page faults and allocator growth are not conversion
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return min(samples) * 1e3, statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks mooncake-conversion", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--keys", type=int, default=2312)
    parser.add_argument("--regions", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    keys_n, regions = args.keys, args.regions

    with (
        MooncakeMaster() as master,
        MooncakeBackend.from_master(master.address, global_segment_size="512MiB") as be,
    ):
        store = be._store  # the raw binding, to time its conversion alone
        nbytes = keys_n * regions * REGION_BYTES
        src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros_like(src)
        be.register_buffer(src.ctypes.data, src.nbytes)
        be.register_buffer(dst.ctypes.data, dst.nbytes)
        # What the worker passes: 2-D int64 addresses and a read-only broadcast (stride 0) of sizes.
        offsets = np.arange(keys_n * regions, dtype=np.int64).reshape(keys_n, regions) * REGION_BYTES
        addrs = src.ctypes.data + offsets
        sizes = np.broadcast_to(np.full((1, regions), REGION_BYTES, dtype=np.int64), (keys_n, regions))
        addr_lists, size_lists = addrs.tolist(), sizes.tolist()
        addrs_u64, sizes_u64 = addrs.astype(np.uint64), np.ascontiguousarray(sizes).astype(np.uint64)
        one = ["conversion-only"]
        get = store.batch_get_into_multi_buffers
        table = RegionTable.from_arguments([""] * keys_n, addrs, sizes)

        conversion = [
            ("lists of Python ints (prebuilt)", lambda: get(one, addr_lists, size_lists)),
            (
                "tuples of Python ints (prebuilt)",
                (lambda a, s: lambda: get(one, a, s))(
                    tuple(map(tuple, addr_lists)), tuple(map(tuple, size_lists))
                ),
            ),
            ("2-D int64 arrays (sizes a stride-0 view)", lambda: get(one, addrs, sizes)),
            ("2-D uint64 arrays", lambda: get(one, addrs_u64, sizes_u64)),
            ("list of 1-D int64 arrays", lambda: get(one, list(addrs), list(sizes))),
        ]
        from_worker = [
            ("2-D int64 arrays passed as they are", lambda: get(one, addrs, sizes)),
            ("ndarray.tolist() of both, then lists", lambda: get(one, addrs.tolist(), sizes.tolist())),
            (
                "aiokv region_lists (one shared sizes row), then lists",
                lambda: get(one, *region_lists(table, None)),
            ),
        ]
        building = [
            ("ndarray.tolist() of both", lambda: (addrs.tolist(), sizes.tolist())),
            ("aiokv region_lists", lambda: region_lists(table, None)),
            (
                "aiokv checks: RegionTable + RegisteredMemory.valid_keys",
                lambda: be._memory.valid_keys(RegionTable.from_arguments(one * keys_n, addrs, sizes)),
            ),
        ]
        keys = [f"bench-{k}" for k in range(keys_n)]
        # Each put needs keys not yet stored (a put of a present key does nothing); the last one
        # stores ``keys``, which the gets read back.
        fresh = iter([[f"bench{i}-{k}" for k in range(keys_n)] for i in range(args.repeats)] + [keys])
        dst_addrs = dst.ctypes.data + offsets
        end_to_end = [
            ("MooncakeBackend.batch_put", lambda: be.batch_put(next(fresh), addrs, sizes)),
            ("MooncakeBackend.batch_get", lambda: be.batch_get(keys, dst_addrs, sizes)),
            ("raw binding get, 2-D int64 arrays", lambda: get(keys, dst_addrs, sizes)),
            ("raw binding get, lists from .tolist()", lambda: get(keys, dst_addrs.tolist(), sizes.tolist())),
        ]

        print(
            f"{keys_n} keys x {regions} regions ({keys_n * regions:,} (address, size) pairs); "
            f"best / median of {args.repeats}, ms\n"
        )
        for title, rows in [
            ("Binding conversion alone", conversion),
            ("From the worker's arrays to the call (build + conversion)", from_worker),
            ("Building the lists, and aiokv's own checks (no native call)", building),
        ]:
            print(f"| {title} | best | median |\n|---|---:|---:|")
            for name, fn in rows:
                best, median = _time(fn, args.repeats)
                print(f"| {name} | {best:.1f} | {median:.1f} |")
            print()
        print(f"| Real calls, {REGION_BYTES}-byte regions, same process | best | median |\n|---|---:|---:|")
        for name, fn in end_to_end:
            best, median = _time(fn, args.repeats)
            print(f"| {name} | {best:.1f} | {median:.1f} |")
        if not np.array_equal(src, dst):
            raise SystemExit("bytes read back differ from those written")
        print("\nbytes verified")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
