"""The disk tier (``backend "disk"``: a DiskBackend per rank, no server to run) under vLLM's OpenAI
server: the KV cache survives a restart.

Server A stores prompts whose lengths are not multiples of the block size and is stopped with SIGINT;
files are then damaged on disk (one cut short, one with a changed byte); a fresh server B on the same
directory answers the stored prompts whole from its first request (each rank's listing reaches the
scheduler at vLLM's start-up handshake), with the greedy outputs of a server without any connector;
the damaged chunks are recomputed, never loaded, their files removed, and stored again. At TP 2 each
rank keeps its shard in a directory of its own, and after a restart a chunk hits only if every rank
still holds it. The logprob tolerance comes from controls run here: the prompts at once, and behind
vLLM's own prefix cache (a tail, or one token, computed behind cached blocks, as after a hit).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from aiokv.backends.disk_format import ALIGN
from aiokv.testing.tiny_model import write_tiny_llama, write_word_tokenizer
from aiokv.testing.vllm_server import running_server
from tests.vllm.support import (
    BLOCK,
    PARALLEL_ENV,
    ROOT,
    assert_same_greedy,
    connector,
    greedy_tolerance,
    one_token_left,
    require_vllm,
    server_reference,
    tokens,
    wait_until,
)

P = tokens(60, 2000)  # 15 full blocks and a partial one
Q = tokens(61, 1700)
CUT = tokens(62, 1500)  # its chunk CUT_CHUNK's file is cut short between the servers
FLIPPED = tokens(63, 1300)  # a byte of its chunk FLIPPED_CHUNK's value is changed between the servers
CUT_CHUNK, FLIPPED_CHUNK = 5, 3
PROMPTS = [P, Q, CUT, FLIPPED]
SETTLE_S = 120  # until every store is on disk and reported: a bound, not a speed figure
TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
# One allowed core per rank's threads (vLLM's CPU worker refuses to bind two workers otherwise).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": PARALLEL_ENV["VLLM_CPU_OMP_THREADS_BIND"]}
MISSING_CHUNK = 4  # at TP 2, Q's chunk whose file only rank 1 loses


def disk_connector(path: Path) -> dict[str, Any]:
    return connector({"backend": "disk", "disk_path": str(path), "disk_capacity": "256MiB"})


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-disk-tier")
    (root / "kv").mkdir()
    return {
        "root": root,
        "model": write_word_tokenizer(write_tiny_llama(root / "tiny-llama")),
        "kv": root / "kv",
    }


def serve(
    world: dict[str, Any], name: str, kv: dict[str, Any] | None, tp: int = 1, extra: Sequence[str] = ()
) -> Any:
    args, env = (TP2_ARGS, TP2_ENV) if tp == 2 else ((), {})
    return running_server(
        world["model"],
        world["root"] / f"{name}.log",
        kv_transfer_config=kv,
        env={"PYTHONPATH": str(ROOT), **env},
        extra_args=(*args, *extra),
    )


@pytest.fixture(scope="module")
def reference(root: dict[str, Any]) -> dict[str, Any]:
    """Each prompt computed whole ("solo"), and the controls of the numerics a hit may move on this
    CPU: the prompts at once ("concurrent"), and behind vLLM's own prefix cache ("warm": the partial
    last block computed; "one_left_warm": one token computed, against its "solo" computed whole)."""
    one_left = [one_token_left(prompt) for prompt in PROMPTS]
    with serve(root, "reference", None) as server:
        reference = server_reference(server, PROMPTS, also_alone=one_left)
    with serve(root, "prefix-cache", None, extra=("--enable-prefix-caching",)) as server:
        for prompt in PROMPTS:
            server.complete(prompt)  # now in vLLM's prefix cache
        reference["warm"] = [server.complete(prompt).as_output() for prompt in PROMPTS]
        reference["one_left_warm"] = [server.complete(prompt).as_output() for prompt in one_left]
    assert all(out["cached"] > 0 for out in [*reference["warm"], *reference["one_left_warm"]])
    return reference


def controls(reference: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    solo = reference["solo"]
    return [
        *((solo[tuple(p)], out) for p, out in zip(PROMPTS, reference["concurrent"], strict=True)),
        *((solo[tuple(p)], out) for p, out in zip(PROMPTS, reference["warm"], strict=True)),
        *(
            (solo[tuple(one_token_left(p))], out)
            for p, out in zip(PROMPTS, reference["one_left_warm"], strict=True)
        ),
    ]


@pytest.fixture(scope="module")
def tolerance(reference: dict[str, Any]) -> float:
    return greedy_tolerance(controls(reference))


def value_files(kv: Path, rank: int = 0) -> dict[Path, int]:
    """A rank's value files and their generations (its directory's write counter, in the name)."""
    return {path: int(path.stem.split("-")[1], 16) for path in (kv / f"rank-{rank}").glob("*/*.kv")}


def whole_hit(server: Any, prompt: list[int]) -> bool:
    return bool(server.complete(prompt).cached == len(prompt))


def store_alone(
    server: Any, kv: Path, prompt: list[int], ranks: int = 1
) -> tuple[dict[str, Any], list[list[Path]]]:
    """Store ``prompt`` and wait until it hits whole: its output computed whole, and its files on each
    rank (full blocks in order, then the tail)."""
    before = [set(value_files(kv, rank)) for rank in range(ranks)]
    computed = server.complete(prompt).as_output()
    wait_until(lambda: whole_hit(server, prompt), SETTLE_S, f"a {len(prompt)}-token prompt stored")
    out = []
    for rank in range(ranks):
        files = {path: gen for path, gen in value_files(kv, rank).items() if path not in before[rank]}
        assert len(files) == len(prompt) // BLOCK + 1
        out.append(sorted(files, key=files.__getitem__))
    return computed, out


@pytest.fixture(scope="module")
def stored(root: dict[str, Any]) -> dict[str, Path]:
    """Server A stores every prompt, and is stopped with SIGINT; then one file is cut short and one
    value byte changed."""
    kv = root["kv"]
    with serve(root, "A", disk_connector(kv)) as server:
        for prompt in (P, Q):
            server.complete(prompt)
        wait_until(lambda: whole_hit(server, P) and whole_hit(server, Q), SETTLE_S, "P and Q stored")
        cut = store_alone(server, kv, CUT)[1][0][CUT_CHUNK]
        flipped = store_alone(server, kv, FLIPPED)[1][0][FLIPPED_CHUNK]
    with open(cut, "r+b") as file:
        file.truncate(cut.stat().st_size - ALIGN)
    with open(flipped, "r+b") as file:
        file.seek(ALIGN + 1000)
        byte = file.read(1)
        file.seek(ALIGN + 1000)
        file.write(bytes([byte[0] ^ 0x5A]))
    return {"cut": cut, "flipped": flipped}


@pytest.fixture(scope="module")
def restarted(root: dict[str, Any], stored: dict[str, Path]) -> Iterator[Any]:
    with serve(root, "B", disk_connector(root["kv"])) as server:
        yield server


def test_a_restarted_server_hits_every_block_it_stored(
    restarted: Any, reference: dict[str, Any], tolerance: float
) -> None:
    """From the first request after the restart: every block of P and Q (their last partial blocks
    too) is a hit, loaded from disk, and the outputs are the reference's."""
    for name, prompt in (("P", P), ("Q", Q)):
        got = restarted.complete(prompt).as_output()
        assert got["cached"] == len(prompt), (name, got["cached"])
        assert_same_greedy(got, reference["solo"][tuple(prompt)], tolerance, name)


def test_a_file_cut_short_is_removed_and_its_chunk_recomputed(
    stored: dict[str, Path], restarted: Any, reference: dict[str, Any], tolerance: float
) -> None:
    """The server that opens the directory removes the file cut short: the hit stops before its
    chunk, which is computed (not loaded), with the reference's output, and stored again."""
    assert not stored["cut"].exists()
    got = restarted.complete(CUT).as_output()
    assert got["cached"] == CUT_CHUNK * BLOCK
    assert_same_greedy(got, reference["solo"][tuple(CUT)], tolerance, "cut")
    wait_until(lambda: whole_hit(restarted, CUT), SETTLE_S, "the recomputed chunks stored again")
    again = restarted.complete(CUT).as_output()
    assert_same_greedy(again, reference["solo"][tuple(CUT)], tolerance, "cut, stored again")


def test_a_changed_value_is_refused_removed_and_recomputed(
    stored: dict[str, Path], restarted: Any, reference: dict[str, Any], tolerance: float
) -> None:
    """A value whose bytes changed on disk fails its checksum when loaded: its blocks are recomputed
    (the output is the reference's), the file is removed and the chunk is stored again."""
    assert stored["flipped"].exists()  # headers alone are read at start-up
    got = restarted.complete(FLIPPED).as_output()
    assert_same_greedy(got, reference["solo"][tuple(FLIPPED)], tolerance, "flipped")
    assert not stored["flipped"].exists()
    wait_until(lambda: whole_hit(restarted, FLIPPED), SETTLE_S, "the damaged chunk stored again")
    again = restarted.complete(FLIPPED).as_output()
    assert_same_greedy(again, reference["solo"][tuple(FLIPPED)], tolerance, "flipped, stored again")


def test_tp2_restart_hits_the_chunks_every_rank_holds(
    root: dict[str, Any], reference: dict[str, Any], tolerance: float
) -> None:
    """TP 2: each rank's shard in its own ``rank-<n>``. Q's chunk MISSING_CHUNK, deleted from rank 1's
    directory between the servers, is no hit after the restart (rank 0's file of it is dropped too) and
    is recomputed and stored again; P hits whole, from the first request. Outputs are compared with the
    same prompts computed whole at TP 2 (a TP 2 forward sums its shards in another order than TP 1's)."""
    kv = root["root"] / "kv-tp2"
    kv.mkdir()
    with serve(root, "A-tp2", disk_connector(kv), tp=2) as server:
        computed_p, _ = store_alone(server, kv, P, ranks=2)
        computed_q, q_files = store_alone(server, kv, Q, ranks=2)
    assert computed_p["cached"] == computed_q["cached"] == 0
    q_files[1][MISSING_CHUNK].unlink()
    with serve(root, "B-tp2", disk_connector(kv), tp=2) as server:
        got = server.complete(P).as_output()
        assert got["cached"] == len(P)
        assert_same_greedy(got, computed_p, tolerance, "P at TP 2")
        got = server.complete(Q).as_output()
        assert got["cached"] == MISSING_CHUNK * BLOCK
        assert_same_greedy(got, computed_q, tolerance, "Q at TP 2")
        assert not q_files[0][MISSING_CHUNK].exists()
        wait_until(lambda: whole_hit(server, Q), SETTLE_S, "Q stored again on both ranks")
