"""Chunk keys: chained hashing, determinism across processes, block-hash input, namespaces."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import HashedPrompt, InvalidRequestError, KeyNamespace, KVLayout, chunk_hashes
from aiokv.keys import DIGEST_HEX_CHARS, chain_seed, token_bytes

CHUNK = 4


def expected_hashes(tokens: list[int], chunk_tokens: int) -> list[str]:
    """The documented definition, written independently: SHA-256(previous || chunk as <u4), seeded
    with the chunk size, truncated to 128 bits of hex."""
    previous = hashlib.sha256(f"aiokv-chunk-v1|{chunk_tokens}".encode()).digest()
    out = []
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + chunk_tokens])
        previous = hashlib.sha256(previous + data).digest()
        out.append(previous.hex()[:DIGEST_HEX_CHARS])
    return out


# -- chunk_hashes ------------------------------------------------------------------------------------


def test_chunk_hashes_match_the_documented_definition() -> None:
    tokens = [0, 1, 2, 3, 70000, 2**32 - 1, 5, 6, 9]
    got = chunk_hashes(tokens, CHUNK)
    assert got == expected_hashes(tokens, CHUNK)
    assert len(got) == 2  # the trailing partial chunk (token 9) gets no digest
    assert all(len(h) == 32 and int(h, 16) >= 0 for h in got)


@pytest.mark.parametrize("length", [0, 1, 3])
def test_no_digest_without_a_whole_chunk(length: int) -> None:
    assert chunk_hashes(list(range(length)), CHUNK) == []


def test_trailing_tokens_do_not_change_whole_chunk_digests() -> None:
    tokens = list(range(12))
    assert chunk_hashes([*tokens, 99, 98], CHUNK) == chunk_hashes(tokens, CHUNK)


def test_token_id_forms_agree() -> None:
    tokens = list(range(100, 140))
    expected = chunk_hashes(tokens, 8)
    forms = [
        np.asarray(tokens, dtype=np.int64),
        np.asarray(tokens, dtype=np.int32),
        np.asarray(tokens, dtype=np.uint32),
        np.asarray(tokens, dtype=np.uint16),
        tuple(tokens),
    ]
    for form in forms:
        assert chunk_hashes(form, 8) == expected


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=64),
    st.integers(1, 8),
    st.data(),
)
def test_chain_property(tokens: list[int], chunk_tokens: int, data: st.DataObject) -> None:
    """Equal prefixes give equal digests; changing token ``i`` changes digest of its chunk and every
    later one, and no earlier one."""
    base = chunk_hashes(tokens, chunk_tokens)
    assert base == expected_hashes(tokens, chunk_tokens)
    index = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[index] = (changed[index] + 1) % 2**32
    other = chunk_hashes(changed, chunk_tokens)
    first_changed = index // chunk_tokens
    assert other[:first_changed] == base[:first_changed]
    for a, b in zip(base[first_changed:], other[first_changed:], strict=True):
        assert a != b


def test_shared_prefix_then_divergence() -> None:
    prefix = list(range(16))
    a = chunk_hashes(prefix + [1] * 8, CHUNK)
    b = chunk_hashes(prefix + [2] * 8, CHUNK)
    assert a[:4] == b[:4]
    assert a[4] != b[4] and a[5] != b[5]
    # Same chunk contents after a different prefix: still a different key (the chain carries it).
    assert chunk_hashes([7] * 4 + [1] * 4, CHUNK)[1] != chunk_hashes([8] * 4 + [1] * 4, CHUNK)[1]


def test_chunk_size_is_part_of_the_chain() -> None:
    tokens = list(range(16))
    assert chain_seed(4) != chain_seed(8)
    assert chunk_hashes(tokens, 4)[1] != chunk_hashes(tokens, 8)[0]


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        ([1, -1, 2, 3], InvalidRequestError, r"\[0, 2\*\*32\)"),
        ([1, 2**32, 2, 3], InvalidRequestError, r"\[0, 2\*\*32\)"),
        ([1.0, 2.0, 3.0, 4.0], ValueError, "token_ids must hold integers"),
        ([[1, 2], [3, 4]], ValueError, "token_ids must be 1-dimensional"),
        ("abcd", TypeError, "token_ids must be a sequence"),
    ],
)
def test_bad_token_ids(tokens: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        chunk_hashes(tokens, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("chunk_tokens", "error"), [(0, ValueError), (-4, ValueError), (True, TypeError)])
def test_bad_chunk_tokens(chunk_tokens: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="chunk_tokens"):
        chunk_hashes([1, 2, 3, 4], chunk_tokens)  # type: ignore[arg-type]


def test_token_bytes_is_little_endian_uint32() -> None:
    assert bytes(token_bytes([1, 256])) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    big_endian = np.asarray([1, 256], dtype=">u4")
    assert bytes(token_bytes(big_endian)) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


# -- HashedPrompt ------------------------------------------------------------------------------------


def test_hashed_prompt_from_tokens() -> None:
    tokens = list(range(10))
    prompt = HashedPrompt.from_tokens(tokens, CHUNK)
    assert prompt.hashes == tuple(chunk_hashes(tokens, CHUNK))
    assert prompt.chunk_tokens == CHUNK
    assert prompt.num_tokens == 8


def test_from_block_hashes_chains_whole_chunks() -> None:
    blocks = ["h0", "h1", "h2", "h3", "h4"]
    prompt = HashedPrompt.from_block_hashes(blocks, block_size=16, chunk_tokens=32)
    assert len(prompt.hashes) == 2  # 5 blocks = 2 whole chunks of 2 blocks, the fifth is partial
    assert prompt.num_tokens == 64
    again = HashedPrompt.from_block_hashes(blocks[:4], block_size=16, chunk_tokens=32)
    assert again == prompt
    changed = HashedPrompt.from_block_hashes(["x0", *blocks[1:]], block_size=16, chunk_tokens=32)
    assert changed.hashes[0] != prompt.hashes[0] and changed.hashes[1] != prompt.hashes[1]
    tail_changed = HashedPrompt.from_block_hashes(["h0", "h1", "h2", "zz"], 16, 32)
    assert tail_changed.hashes[0] == prompt.hashes[0] and tail_changed.hashes[1] != prompt.hashes[1]


def test_from_block_hashes_accepts_bytes_str_int_and_separates_boundaries() -> None:
    for blocks in (
        [b"\x01\x02", b"\x03"],
        ["a", "b"],
        [12345678901234567890, -5],
        [np.int64(7), 0],
    ):
        prompt = HashedPrompt.from_block_hashes(blocks, 1, 2)
        assert len(prompt.hashes) == 1 and len(prompt.hashes[0]) == DIGEST_HEX_CHARS
    # Length-prefixed: re-splitting the same bytes between blocks gives another key.
    ab_c = HashedPrompt.from_block_hashes(["ab", "c"], 1, 2)
    a_bc = HashedPrompt.from_block_hashes(["a", "bc"], 1, 2)
    assert ab_c.hashes != a_bc.hashes
    # Block-hash chains never meet token chains.
    assert HashedPrompt.from_block_hashes([1, 2], 1, 2).hashes != tuple(chunk_hashes([1, 2], 2))


def test_engine_digests_cost_one_sha256_per_block_after_their_type_and_length() -> None:
    """Block hashes all bytes of one length (an engine's digests, one block per chunk): the typed,
    length-prefixed head is folded into the chain once, then one SHA-256 per block over (previous
    digest, hash), for short and long prompts alike (hex made one by one or in bulk)."""
    for count in (3, 300):
        blocks = [hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(count)]
        prompt = HashedPrompt.from_block_hashes(blocks, 16, 16)
        head = b"b" + (32).to_bytes(4, "little")  # bytes, 32 long
        previous = hashlib.sha256(chain_seed(16) + b"|blocks" + head).digest()
        expected = []
        for value in blocks:
            previous = hashlib.sha256(previous + value).digest()
            expected.append(previous[: DIGEST_HEX_CHARS // 2].hex())
        assert list(prompt.hashes) == expected
    # Hashes of another length start another chain: the same leading bytes never give the same key.
    shorter = HashedPrompt.from_block_hashes([b[:31] for b in blocks], 16, 16)
    assert not set(shorter.hashes) & set(prompt.hashes)


@pytest.mark.parametrize(
    ("blocks", "block_size", "chunk_tokens", "error", "message"),
    [
        (["a"], 16, 24, InvalidRequestError, "not a multiple of block_size 16"),
        (["a"], 0, 16, InvalidRequestError, "block_size must be positive"),
        ([True], 1, 1, TypeError, r"block_hashes\[0\] must be bytes, str or int, not bool"),
        (["a", 1.5], 1, 1, TypeError, r"block_hashes\[1\] must be bytes, str or int, not float"),
        ("abc", 1, 1, TypeError, "must be a sequence of block hashes"),
    ],
)
def test_from_block_hashes_bad_input(
    blocks: object, block_size: int, chunk_tokens: int, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        HashedPrompt.from_block_hashes(blocks, block_size, chunk_tokens)  # type: ignore[arg-type]


# -- namespaces --------------------------------------------------------------------------------------


def test_keys_carry_every_namespace_field() -> None:
    hashes = chunk_hashes(list(range(8)), CHUNK)
    ns = KeyNamespace("meta-llama/Llama-3.1-8B@main", tp_rank=3, pp_rank=1)
    keys = ns.keys(hashes, "abcdef012345", group=2)
    assert keys == [f"meta-llama/Llama-3.1-8B@main/abcdef012345.g2.tp3.pp1/{h}" for h in hashes]
    for key in keys:
        assert isinstance(key, str) and key.isprintable() and not any(c.isspace() for c in key)
        assert len(key) < 100


def test_each_namespace_field_separates_keys() -> None:
    hashes = chunk_hashes(list(range(4)), CHUNK)
    base = KeyNamespace("m", tp_rank=0, pp_rank=0).keys(hashes, "fp", 0)
    variants = [
        KeyNamespace("m2").keys(hashes, "fp", 0),
        KeyNamespace("m", tp_rank=1).keys(hashes, "fp", 0),
        KeyNamespace("m", pp_rank=1).keys(hashes, "fp", 0),
        KeyNamespace("m").keys(hashes, "fp2", 0),
        KeyNamespace("m").keys(hashes, "fp", 1),
    ]
    keys = {tuple(base), *(tuple(v) for v in variants)}
    assert len(keys) == 1 + len(variants)


def test_share_across_tp_gives_one_key_for_all_tp_ranks() -> None:
    hashes = chunk_hashes(list(range(4)), CHUNK)
    shared = {
        tuple(KeyNamespace("m", tp_rank=r, share_across_tp=True).keys(hashes, "fp", 0)) for r in range(4)
    }
    assert len(shared) == 1
    assert next(iter(shared))[0] == f"m/fp.g0.tp*.pp0/{hashes[0]}"
    # PP ranks hold different layers: still separate when sharing across TP.
    pp1 = KeyNamespace("m", pp_rank=1, share_across_tp=True).keys(hashes, "fp", 0)
    assert tuple(pp1) not in shared
    unshared = {tuple(KeyNamespace("m", tp_rank=r).keys(hashes, "fp", 0)) for r in range(4)}
    assert len(unshared) == 4


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": ""}, TypeError),
        ({"model": 5}, TypeError),
        ({"model": "my model"}, InvalidRequestError),
        ({"model": "m\n"}, InvalidRequestError),
        ({"model": "m\x00"}, InvalidRequestError),
        ({"model": "m", "tp_rank": -1}, InvalidRequestError),
        ({"model": "m", "pp_rank": True}, InvalidRequestError),
        ({"model": "m", "tp_rank": 1.0}, InvalidRequestError),
    ],
)
def test_namespace_validation(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        KeyNamespace(**kwargs)  # type: ignore[arg-type]


def test_layout_fingerprint_in_keys_ignores_addresses() -> None:
    hashes = chunk_hashes(list(range(4)), CHUNK)
    ns = KeyNamespace("m")
    here = KVLayout([1 << 20, 2 << 20], [256], 16, 100, dtype="bfloat16")
    elsewhere = KVLayout([9 << 30, 5 << 30], [256], 16, 4000, dtype="bfloat16")
    other_dtype = KVLayout([1 << 20, 2 << 20], [256], 16, 100, dtype="float16")
    assert ns.keys(hashes, here.fingerprint, 0) == ns.keys(hashes, elsewhere.fingerprint, 0)
    assert ns.keys(hashes, here.fingerprint, 0) != ns.keys(hashes, other_dtype.fingerprint, 0)


# -- across processes ----------------------------------------------------------------------------------

_CHILD = """
import json
from aiokv import HashedPrompt, KeyNamespace, KVLayout, chunk_hashes
tokens = [(i * 7919) % 151936 for i in range(1000)]
layout = KVLayout([4096 * (1 + {offset})], [512], 16, 64, dtype="bfloat16")
ns = KeyNamespace("org/model-name", tp_rank=1, pp_rank=0)
print(json.dumps({{
    "hashes": chunk_hashes(tokens, 64),
    "keys": ns.keys(chunk_hashes(tokens, 64), layout.fingerprint, 0),
    "blocks": list(HashedPrompt.from_block_hashes(["s%d" % i for i in range(8)] + [3, b"x"], 16, 32).hashes),
    "fingerprint": layout.fingerprint,
}}))
"""


def _child_result(hash_seed: str, offset: int) -> dict[str, list[str] | str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(offset=offset)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def test_keys_identical_across_interpreters_with_different_hash_seeds() -> None:
    first = _child_result("0", offset=0)
    second = _child_result("4242", offset=5)  # other addresses too: the fingerprint ignores them
    assert first == second
    # And equal to this process's own answer, whatever its hash seed.
    tokens = [(i * 7919) % 151936 for i in range(1000)]
    assert first["hashes"] == chunk_hashes(tokens, 64) == expected_hashes(tokens, 64)
    assert len(first["hashes"]) == 15
    # The children really ran with different seeds: salted str hashes differ between them.
    probe = "import sys; print(hash('aiokv'))"
    salted = {
        subprocess.run(
            [sys.executable, "-c", probe],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "4242")
    }
    assert len(salted) == 2
