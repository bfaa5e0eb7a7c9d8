"""Deterministic chunk keys: chained prefix hashes plus a namespace.

Chunk ``i``'s digest is ``SHA-256(digest[i-1] || tokens of chunk i)``, seeded with the chunk size, so
equal prefixes give equal keys in every process (no salted ``hash()``), and a change to an early token
changes every later key. Tokens are hashed as little-endian uint32 (every vocabulary fits). The
namespace (model, layout fingerprint, group, ranks) is put in front when keys are built.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._arrays import as_int64_array, as_positive_int
from .errors import InvalidRequestError

TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]
BlockHash = bytes | str | int

DIGEST_HEX_CHARS = 32  # 128 bits of the SHA-256 digest name a chunk
_FORBIDDEN = frozenset(" \t\r\n")  # whitespace: never inside a key
_TOKEN_LIMIT = 1 << 32


def token_bytes(token_ids: TokenIds) -> memoryview:
    """The canonical byte encoding of a prompt (little-endian uint32), validated."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.dtype("<u4"):
        return np.ascontiguousarray(token_ids).data.cast("B")
    tokens = as_int64_array(token_ids, "token_ids", ndim=1)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= _TOKEN_LIMIT):
        raise InvalidRequestError("token_ids must be in [0, 2**32)")
    return tokens.astype("<u4").data.cast("B")


def chain_seed(chunk_tokens: int) -> bytes:
    """The digest a chain starts from; chunk size is in it so differently chunked caches never meet."""
    return hashlib.sha256(f"aiokv-chunk-v1|{chunk_tokens}".encode()).digest()


def chain_digests(data: memoryview, piece_bytes: int, count: int, previous: bytes) -> list[bytes]:
    """Digests of ``count`` consecutive pieces of ``data``, each chained on the one before.

    Callers slice long prompts into several calls (passing the last digest on) to bound how long one
    call holds the GIL.
    """
    out: list[bytes] = []
    append = out.append
    new_hash = hashlib.sha256().copy  # copying a ready context is cheaper than a fresh constructor
    for offset in range(0, count * piece_bytes, piece_bytes):
        h = new_hash()
        h.update(previous)
        h.update(data[offset : offset + piece_bytes])
        previous = h.digest()
        append(previous)
    return out


_SHA256_BYTES = 32
_BULK_HEX_DIGESTS = 256  # below this many, one hex() per digest is as cheap as the bulk conversion


def uint32_tokens(tokens: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint32] | None:
    """A copy of ``tokens`` in the canonical encoding (:func:`token_bytes` then only views it), or None
    when a value is outside ``[0, 2**32)`` (the hashing reports it)."""
    in_range = tokens.dtype == np.dtype("<u4") or not tokens.size
    if not in_range and tokens.dtype == np.int64:
        # As uint64 a negative value is past the limit too: one reduction instead of two.
        in_range = int(tokens.view(np.uint64).max()) < _TOKEN_LIMIT
        if not in_range:
            return None
    if not in_range and (int(tokens.min()) < 0 or int(tokens.max()) >= _TOKEN_LIMIT):
        return None
    return tokens.astype("<u4")  # always a copy


def digests_to_hex(digests: Sequence[bytes]) -> list[str]:
    """The first DIGEST_HEX_CHARS hex digits of each digest, converted in one C call (not one per
    digest: ~0.2 us each, a quarter of a chained SHA-256)."""
    width = DIGEST_HEX_CHARS // 2
    if len(digests) < _BULK_HEX_DIGESTS:
        return [d[:width].hex() for d in digests]
    lengths = set(map(len, digests))
    if len(lengths) == 1 and (length := lengths.pop()) >= width:
        return _digest_rows_to_hex(digests, length)
    return b"".join([d[:width] for d in digests]).hex(" ", width).split(" ")


def _digest_rows_to_hex(digests: Sequence[bytes], length: int) -> list[str]:
    """:func:`digests_to_hex` of digests all ``length`` bytes long (the caller knows it)."""
    width = DIGEST_HEX_CHARS // 2
    if len(digests) < _BULK_HEX_DIGESTS:
        return [d[:width].hex() for d in digests]
    rows = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), length)
    # A contiguous copy first: tobytes() of the strided view walks it byte by byte (4x slower).
    return np.ascontiguousarray(rows[:, :width]).tobytes().hex(" ", width).split(" ")


def _token_digests(token_ids: TokenIds, chunk_tokens: int) -> list[bytes]:
    data = token_bytes(token_ids)
    count = len(data) // 4 // chunk_tokens
    return chain_digests(data, 4 * chunk_tokens, count, chain_seed(chunk_tokens))


def chunk_hashes(token_ids: TokenIds, chunk_tokens: int) -> list[str]:
    """One hex digest per whole chunk of ``token_ids`` (a trailing partial chunk has none)."""
    return digests_to_hex(_token_digests(token_ids, as_positive_int(chunk_tokens, "chunk_tokens")))


def _block_hash_bytes(value: object, index: int) -> bytes:
    if isinstance(value, bytes):
        tag, raw = b"b", value
    elif isinstance(value, str):
        tag, raw = b"s", value.encode()
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        number = int(value)
        tag, raw = b"i", number.to_bytes(number.bit_length() // 8 + 1, "little", signed=True)
    else:
        raise TypeError(f"block_hashes[{index}] must be bytes, str or int, not {type(value).__name__}")
    # Typed and length-prefixed, so that no two different hash sequences give the same bytes.
    return tag + len(raw).to_bytes(4, "little") + raw


def _common_bytes_head(block_hashes: Iterable[object]) -> bytes | None:
    """What :func:`_block_hash_bytes` puts before each hash when all are ``bytes`` of one length
    (checked at C speed), else None."""
    if not isinstance(block_hashes, Sequence) or set(map(type, block_hashes)) != {bytes}:
        return None
    lengths = set(map(len, block_hashes))  # type: ignore[arg-type]
    return b"b" + lengths.pop().to_bytes(4, "little") if len(lengths) == 1 else None


_KEY_ASCII = bytes(range(0x21, 0x7F))  # printable ASCII but space


def _all_clean(digests: tuple[object, ...]) -> bool:
    """Whether every digest is a non-empty printable str without whitespace, at C speed (~1 ms for
    62,500 digests); False sends the caller to the walk that names the bad one."""
    try:
        joined = "".join(digests)  # type: ignore[arg-type]
    except TypeError:
        return False
    if "" in digests:
        return False
    if joined.isascii():
        return not joined.encode().translate(None, _KEY_ASCII)
    return joined.isprintable() and _FORBIDDEN.isdisjoint(joined)


def _check_digest(digest: object, name: str) -> None:
    if not isinstance(digest, str):
        raise TypeError(f"{name} must be a str digest, not {type(digest).__name__}")
    if not digest or not digest.isprintable() or not _FORBIDDEN.isdisjoint(digest):
        raise InvalidRequestError(f"{name} = {digest!r} must be a non-empty printable str without whitespace")


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    """A prompt reduced to its chunk digests: what the worker needs to build keys.

    Compute it once per request (``HashedPrompt.from_tokens``) and reuse it for lookup, load and store;
    engines that already hash their blocks use ``from_block_hashes``.
    """

    hashes: tuple[str, ...]
    chunk_tokens: int

    def __post_init__(self) -> None:
        """The one check of a prompt's digests, whoever built it: each becomes the tail of a store key,
        so it must be a non-empty printable ``str`` without whitespace, and no two chunks of one
        prompt may share one (a load would put one chunk's bytes into another chunk's blocks)."""
        hashes = self.hashes
        if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
            raise TypeError(f"hashes must be a sequence of str digests, not {type(hashes).__name__}")
        # The prompt's own tuple: a list the caller keeps could change after a store() returned.
        hashes = tuple(hashes)
        object.__setattr__(self, "hashes", hashes)
        object.__setattr__(self, "chunk_tokens", as_positive_int(self.chunk_tokens, "chunk_tokens"))
        if not _all_clean(hashes):
            for index, digest in enumerate(hashes):
                _check_digest(digest, f"hashes[{index}]")
        if len(set(hashes)) != len(hashes):
            seen: dict[str, int] = {}
            for index, digest in enumerate(hashes):
                if digest in seen:
                    raise InvalidRequestError(
                        f"hashes[{index}] repeats hashes[{seen[digest]}] ({digest!r}): every chunk of a "
                        "prompt needs its own digest"
                    )
                seen[digest] = index

    @property
    def num_tokens(self) -> int:
        """Tokens covered by whole chunks."""
        return len(self.hashes) * self.chunk_tokens

    @classmethod
    def _chained(cls, digests: list[bytes], chunk_tokens: int) -> HashedPrompt:
        """A prompt of digests this module chained itself: hex, so clean, and distinct (two equal
        chained 128-bit digests would be a SHA-256 collision), so ``__post_init__``'s checks, a fifth
        of the hashing's cost on long prompts, are skipped."""
        prompt = object.__new__(cls)
        object.__setattr__(prompt, "hashes", tuple(_digest_rows_to_hex(digests, _SHA256_BYTES)))
        object.__setattr__(prompt, "chunk_tokens", chunk_tokens)
        return prompt

    @classmethod
    def from_tokens(cls, token_ids: TokenIds, chunk_tokens: int) -> HashedPrompt:
        chunk_tokens = as_positive_int(chunk_tokens, "chunk_tokens")
        return cls._chained(_token_digests(token_ids, chunk_tokens), chunk_tokens)

    @classmethod
    def from_block_hashes(
        cls, block_hashes: Sequence[BlockHash], block_size: int, chunk_tokens: int
    ) -> HashedPrompt:
        """Chain the engine's per-block hashes (bytes, str or int) chunk by chunk."""
        block_size = as_positive_int(block_size, "block_size")
        chunk_tokens = as_positive_int(chunk_tokens, "chunk_tokens")
        if chunk_tokens % block_size:
            raise InvalidRequestError(
                f"chunk_tokens {chunk_tokens} is not a multiple of block_size {block_size}"
            )
        if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Iterable):
            raise TypeError("block_hashes must be a sequence of block hashes")
        per_chunk = chunk_tokens // block_size
        previous = chain_seed(chunk_tokens) + b"|blocks"
        digests: list[bytes] = []
        head = _common_bytes_head(block_hashes) if per_chunk == 1 else None
        if head is not None:
            # One block per chunk, every hash bytes of one length (an engine's digests): the typed,
            # length-prefixed head _block_hash_bytes gives each is then the same, so it is folded into
            # the chain once, and each block costs one SHA-256 over (previous digest, hash): the
            # floor of any chained derivation. (The fold starts the chain from another digest than
            # the general path's, so the two never meet.)
            previous = hashlib.sha256(previous + head).digest()
            sha256, append = hashlib.sha256, digests.append
            for value in block_hashes:
                previous = sha256(previous + value).digest()  # type: ignore[operator]
                append(previous)
        else:
            encoded = [_block_hash_bytes(v, i) for i, v in enumerate(block_hashes)]
            for start in range(0, len(encoded) - per_chunk + 1, per_chunk):
                previous = hashlib.sha256(previous + b"".join(encoded[start : start + per_chunk])).digest()
                digests.append(previous)
        return cls._chained(digests, chunk_tokens)


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything besides the prefix that decides whose bytes a key names.

    ``model``: the model (and revision) name. ``tp_rank``/``pp_rank``: the ranks whose shard of the KV
    cache this process holds. ``share_across_tp``: the KV is byte-identical on every TP rank (MLA), so
    all TP ranks use one key.
    """

    model: str
    tp_rank: int = 0
    pp_rank: int = 0
    share_across_tp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError("model must be a non-empty str")
        if not self.model.isprintable() or _FORBIDDEN & set(self.model):
            raise InvalidRequestError(f"model {self.model!r} must be printable and without whitespace")
        if not isinstance(self.share_across_tp, (bool, np.bool_)):
            raise TypeError(f"share_across_tp must be a bool, got {self.share_across_tp!r}")
        for name in ("tp_rank", "pp_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{name} must be an int >= 0, got {value!r}")

    def prefix(self, layout_fingerprint: str, group: int) -> str:
        """The part of every key of one group that precedes the chunk digest."""
        tp = "*" if self.share_across_tp else str(self.tp_rank)
        return f"{self.model}/{layout_fingerprint}.g{group}.tp{tp}.pp{self.pp_rank}/"

    def keys(self, hashes: Sequence[str], layout_fingerprint: str, group: int) -> list[str]:
        prefix = self.prefix(layout_fingerprint, group)
        return [prefix + h for h in hashes]
