"""Streaming webdataset shards per data-parallel rank, with a resumable position.

Each data-parallel rank reads its own shards (``shards[dp_rank::dp_size]``, then ``[worker::num_workers]`` inside a
loader worker), shuffles their order per epoch with a seed every rank derives the same way, decodes samples and
packs them into micro-batches. The stream is endless (epochs follow one another), so every rank always has a next
batch and no rank can leave a collective early; training length is set by ``max_steps``.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch.distributed as dist
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info
from typing_extensions import override
from webdataset.tariterators import group_by_keys, tar_file_expander

from omni_lightning.batch import BYTE_ROLES, PackingSpec
from omni_lightning.data.packing import DecodedSample, check_packable, data_counts, pack_samples
from omni_lightning.data.position import (
    POSITION_DELTA_KEY,
    DataPosition,
    PositionDelta,
    PositionMismatch,
    SampleSource,
    shard_list_digest,
)
from omni_lightning.modalities import DEFAULT_PACKING

__all__ = [
    "BadSample",
    "SampleStream",
    "ByteTokenizer",
    "ShardStream",
    "StalledRead",
    "Tokenizer",
    "assign_shards",
    "check_read_timeout",
    "decode_sample",
    "open_shard",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


def assign_shards(shards: list[T], *, dp_rank: int, dp_size: int, num_workers: int = 1) -> list[list[T]]:
    """The shard list of every loader worker of one data-parallel rank.

    Raises ``ValueError`` if some worker would get no shard: it would end its stream at once and its rank would
    fall out of step with the others.
    """
    needed = dp_size * max(num_workers, 1)
    if len(shards) < needed:
        raise ValueError(
            f"{len(shards)} shards cannot feed {dp_size} data-parallel ranks x {max(num_workers, 1)} loader workers:"
            f" write at least {needed} shards or lower num_workers"
        )
    mine = shards[dp_rank::dp_size]
    return [mine[w :: max(num_workers, 1)] for w in range(max(num_workers, 1))]


class Tokenizer(Protocol):
    """Turns raw sample text (a ``txt`` member) into token ids that are not the token roles' ids."""

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, shifted past the reserved ids: needs no download, covers any text (vocab >= 260)."""

    def encode(self, text: str) -> list[int]:
        return [BYTE_ROLES.first_free_id + byte for byte in text.encode("utf-8")]


@dataclass(frozen=True)
class BadSample:
    """A sample (or the rest of a shard) that could not be used, kept so that the skip is counted and logged."""

    shard: str
    key: str
    reason: str
    source: SampleSource | None = None


def _with_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """``(item, is_last)`` for each item: one item of look-ahead. An error reading the next item comes after the item
    in hand (which was whole), so it is not lost."""
    try:
        current = next(items)
    except StopIteration:
        return
    while True:
        try:
            following = next(items)
        except StopIteration:
            yield current, True
            return
        except BaseException:
            yield current, False  # the broken rest of the shard follows it
            raise
        yield current, False
        current = following


def decode_sample(
    raw: dict[str, Any], *, patch_size: int | None = None, tokenizer: Tokenizer | None = None
) -> DecodedSample:
    """Decode one webdataset sample written by ``make_synthetic_shards`` (or in the same format) and check it
    against its metadata; raises ``ValueError`` naming the sample and the problem.

    Text comes from ``tokens.npy`` or, if absent, from ``txt`` through ``tokenizer`` (bytes by default); images from
    ``img{i}.png``, a video from ``video.npy`` (uint8 ``[frames, H, W, 3]``), audio from ``mel.npy``.
    """
    key = raw.get("__key__", "?")
    try:
        meta = json.loads(raw["json"])
        if not isinstance(meta, dict):
            raise ValueError(f"sample {key}: metadata 'json' is a JSON {type(meta).__name__}, not an object")
        if "tokens.npy" in raw:
            tokens = _load_npy(raw, "tokens.npy", key)
        elif "txt" in raw:
            text = raw["txt"].decode("utf-8") if isinstance(raw["txt"], bytes) else raw["txt"]
            tokens = np.asarray((tokenizer or ByteTokenizer()).encode(text), dtype=np.int64)
        else:
            raise KeyError("tokens.npy")
        media: dict[str, list[np.ndarray]] = {
            "image": [_decode_image(raw[f"img{i}.png"], key, i) for i in range(len(meta.get("images", [])))],
        }
    except KeyError as missing:
        name = missing.args[0]
        alternative = " (and there is no 'txt' to tokenize)" if name == "tokens.npy" else ""
        raise ValueError(f"sample {key}: member '{name}' is missing{alternative}") from None
    if "video.npy" in raw:
        media["video"] = [_load_npy(raw, "video.npy", key)]
    if "mel.npy" in raw:
        media["audio"] = [_load_npy(raw, "mel.npy", key)]
    sample = DecodedSample(key=key, tokens=tokens, meta=meta, media=media)
    _check_against_meta(sample, patch_size)
    return sample


def _load_npy(raw: dict[str, Any], member: str, key: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(raw[member]), allow_pickle=False)
    except Exception as error:  # corrupt headers also raise SyntaxError or tokenize.TokenError (found by fuzzing)
        raise ValueError(f"sample {key}: {member} cannot be decoded ({error})") from None


def _decode_image(data: bytes, key: str, index: int) -> np.ndarray:
    try:
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    except Exception as error:  # Pillow's decoders raise more than OSError (SyntaxError, struct.error, bombs, ...)
        raise ValueError(f"sample {key}: img{index}.png cannot be decoded ({error})") from None


def _check_against_meta(sample: DecodedSample, patch_size: int | None) -> None:
    """Metadata drives balancing; a payload that disagrees with it would unbalance or break a step."""
    meta, key = sample.meta, sample.key
    problems = []
    if "text_tokens" in meta and len(sample.tokens) != meta["text_tokens"]:
        problems.append(f"{len(sample.tokens)} text tokens, metadata says {meta['text_tokens']}")
    if len(sample.tokens) == 0:
        problems.append("no text tokens")
    images, videos, clips = (sample.media.get(name, []) for name in ("image", "video", "audio"))
    if patch_size is not None:
        grids = [tuple(g) for g in meta.get("images", [])]
        shapes = [(img.shape[0] // patch_size, img.shape[1] // patch_size) for img in images]
        if shapes != grids:
            problems.append(f"image grids {shapes} (in {patch_size}-pixel patches), metadata says {grids}")
        frames = int(meta.get("video_frames", 0))
        expected = [(frames, *(int(x) for x in meta.get("video_grid", (0, 0))))] if frames else []
        got = [(v.shape[0], v.shape[1] // patch_size, v.shape[2] // patch_size) for v in videos if v.ndim == 4]
        if got != expected or len(videos) != len(got):
            problems.append(f"video (frames, grid) {got} (in {patch_size}-pixel patches), metadata says {expected}")
    frames = clips[0].shape[0] if clips else 0
    if frames != int(meta.get("audio_frames", frames)):
        problems.append(f"{frames} mel frames, metadata says {meta['audio_frames']}")
    if clips and frames == 0:
        problems.append("a zero-length audio clip")
    if problems:
        raise ValueError(f"sample {key}: " + "; ".join(problems))


class StalledRead(RuntimeError):
    """A shard read made no progress for ``read_timeout`` seconds (a hung network file system or object store)."""


def check_read_timeout(read_timeout: float | None) -> None:
    if read_timeout is not None and not read_timeout > 0:
        raise ValueError(f"read_timeout={read_timeout} must be a positive number of seconds (or None: no limit)")


# Bytes one timed read may ask for: a read this size that does not return within the timeout is a stall, however
# large the member being read.
_READ_CHUNK = 1 << 20


class _TimedReads(io.RawIOBase):
    """The bytes of the file ``open_file()`` returns, each call (the open, every read of at most ``_READ_CHUNK``) given
    ``timeout`` seconds: it runs in a helper thread, and a call that does not return in time raises
    :class:`StalledRead`. The helper stays stuck in the call, as a daemon; so does the file (closing it could block)."""

    def __init__(self, open_file: Callable[[], Any], *, timeout: float, url: str) -> None:
        super().__init__()
        self._open, self.timeout, self.url = open_file, timeout, url
        self._file: Any = None
        self.stall: str | None = None  # the stall's message, once one happened

    def _timed(self, call: Callable[[], Any]) -> Any:
        if self.stall is not None:  # the helper of the stalled call is still stuck: no second one
            raise StalledRead(self.stall)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as error:  # handed to the reading thread
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=run, name="omni-shard-read", daemon=True).start()
        if not done.wait(self.timeout):
            self.stall = (f"reading shard {self.url} made no progress for {self.timeout:g} s "
                          f"(read_timeout={self.timeout:g}): its storage stalls")
            raise StalledRead(self.stall)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _handle(self) -> Any:
        if self._file is None:
            self._file = self._timed(self._open)
        return self._file

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        file, size = self._handle(), min(len(buffer), _READ_CHUNK)
        read = getattr(file, "read1", file.read)  # read1: what is there, as a socket or pipe returns it
        data = self._timed(lambda: read(size))  # a copy: a stuck helper must not write into the buffer later
        buffer[: len(data)] = data
        return len(data)

    def seekable(self) -> bool:
        return bool(self._handle().seekable())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._handle().seek(offset, whence))

    def tell(self) -> int:
        return 0 if self._file is None else int(self._file.tell())  # io asks on construction: no open for it

    def close(self) -> None:
        if self._file is not None and self.stall is None:
            self._file.close()
        super().close()


def _opener(url: str) -> Callable[[], Any]:
    if "://" in url and not url.startswith("file://"):
        import fsspec

        return lambda: fsspec.open(url, "rb").open()
    return lambda: open(url.removeprefix("file://"), "rb")  # noqa: SIM115 (closed by open_shard)


def open_shard(url: str, *, read_timeout: float | None = None) -> Iterator[dict[str, Any]]:
    """Raw samples of one shard: a local path, or any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

    A shard that breaks off (truncated, corrupt, a member repeated) still yields every sample completed before the
    break; then ``tarfile.ReadError`` says what broke. With ``read_timeout``, opening the shard or any read that makes
    no progress for that many seconds raises :class:`StalledRead` naming the shard.
    """
    errors: list[Exception] = []
    timed = None if read_timeout is None else _TimedReads(_opener(url), timeout=read_timeout, url=url)

    def stop(error: Exception) -> bool:
        if timed is not None and timed.stall is not None:  # not a broken shard: its storage hangs
            raise StalledRead(timed.stall) from None
        errors.append(error)
        return False  # end the shard here; webdataset then hands out the sample it was holding back

    opened = _opener(url)() if timed is None else io.BufferedReader(timed, buffer_size=_READ_CHUNK)
    try:
        files = tar_file_expander([{"url": url, "stream": opened}], handler=stop)
        yield from group_by_keys(files, handler=stop)
        if not errors and not _ends_with_end_of_archive(opened):
            # tarfile reads a header cut short as the end of the archive; a whole tar ends with two zero blocks.
            errors.append(tarfile.ReadError("no end-of-archive marker: the shard is truncated"))
    finally:
        opened.close()
    if errors:
        raise tarfile.ReadError(str(errors[0]))


def _ends_with_end_of_archive(stream: Any) -> bool:
    """Whether a seekable tar stream ends with the two zero blocks of a complete archive (unseekable: assume so)."""
    if not getattr(stream, "seekable", lambda: False)():
        return True
    stream.seek(0, io.SEEK_END)
    if stream.tell() < 2 * tarfile.BLOCKSIZE:
        return False
    stream.seek(-2 * tarfile.BLOCKSIZE, io.SEEK_END)
    return not any(stream.read(2 * tarfile.BLOCKSIZE))


class ShardStream(IterableDataset):
    """Endless stream of packed micro-batches for one data-parallel rank.

    Its position (``epoch``, ``consumed`` samples of that epoch, per loader worker) is exposed through
    ``state_dict``/``load_state_dict``, which ``torchdata``'s ``StatefulDataLoader`` calls inside each worker, so a
    resumed run continues with exactly the samples that follow the checkpoint. With ``max_batches`` the stream is
    a bounded pass from the start instead (validation): every rank yields the same number of batches.

    Every record carries its :class:`~omni_lightning.data.position.SampleSource` and every training batch the
    :class:`~omni_lightning.data.position.PositionDelta` of what it consumed, from which the loader keeps a position
    that does not depend on the number of ranks; :meth:`resume_from` starts over from such a position under another
    number of ranks.
    """

    def __init__(
        self,
        shards: list[str],
        *,
        dp_rank: int,
        dp_size: int,
        batch_size: int,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_shards: bool = True,
        packing: PackingSpec = DEFAULT_PACKING,
        max_batches: int | None = None,
        on_bad_sample: Literal["skip", "error"] = "error",
        tokenizer: Tokenizer | None = None,
        reader: Callable[[dict[str, Any]], DecodedSample] | None = None,
        read_timeout: float | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        check_read_timeout(read_timeout)
        self.read_timeout = read_timeout
        if on_bad_sample not in ("skip", "error"):
            raise ValueError(f"on_bad_sample={on_bad_sample!r} must be 'skip' or 'error'")
        self.on_bad_sample = on_bad_sample
        self.tokenizer = tokenizer
        self.reader = reader
        self.shards = list(shards)
        self.shard_digest = shard_list_digest(self.shards)
        # Shards by their index in the list: the identity a position records (the same name may appear twice).
        self.worker_shard_ids = assign_shards(list(range(len(shards))), dp_rank=dp_rank, dp_size=dp_size,
                                              num_workers=num_workers)
        self.worker_shards = [[self.shards[i] for i in ids] for ids in self.worker_shard_ids]
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self.packing = packing
        self.max_batches = max_batches
        self._epoch = 0
        self._consumed = 0
        self._resume: DataPosition | None = None  # what was trained before a resume under another number of ranks

    decodes_after_plan = False

    def start_position(self) -> DataPosition:
        """The position of a stream that has read nothing."""
        return DataPosition(self.shard_digest)

    def resume_from(self, position: DataPosition) -> DataPosition:
        """Start over from a position saved under another number of ranks (:func:`~omni_lightning.data.position.
        merge_positions` of every old rank's): read this rank's shards from the first epoch with a record left,
        skipping each record trained before. Returns the part of ``position`` about this rank's shards;
        :class:`~omni_lightning.data.position.PositionMismatch` if it was saved for another shard list."""
        if position.digest != self.shard_digest:
            raise PositionMismatch(f"the loader position was saved for another shard list (digest {position.digest}, "
                                   f"this data module's {len(self.shards)} shards have {self.shard_digest})")
        mine = [i for ids in self.worker_shard_ids for i in ids]
        self._resume = position.restricted_to(mine)
        self._epoch, self._consumed = self._resume.first_open_epoch(mine), 0
        return self._resume.copy()

    def state_dict(self) -> dict[str, int]:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(
                f"loader state of data-parallel rank {state['dp_rank']}/{state['dp_size']} cannot resume rank "
                f"{self.dp_rank}/{self.dp_size}: each rank streams different shards"
            )
        self._epoch, self._consumed = int(state["epoch"]), int(state["consumed"])

    def epoch_shards(self, worker: int, epoch: int) -> list[str]:
        """Shard order of one worker in one epoch: a permutation seeded by (seed, dp rank, worker, epoch)."""
        return [self.shards[i] for i in self._epoch_shard_ids(worker, epoch)]

    def _epoch_shard_ids(self, worker: int, epoch: int) -> list[int]:
        ids = list(self.worker_shard_ids[worker])
        if self.shuffle_shards:
            order = np.random.default_rng([self.seed, self.dp_rank, worker, epoch]).permutation(len(ids))
            ids = [ids[i] for i in order]
        return ids

    def iter_samples(self, worker: int = 0) -> Iterator[DecodedSample | BadSample]:
        """Decoded samples from the current position on, epoch after epoch; advances the position.

        Unusable input (a corrupt or truncated shard, a missing member, an undecodable image, a payload that
        contradicts its metadata) raises ``ValueError`` naming shard and key with ``on_bad_sample="error"``, and
        comes out as a :class:`BadSample` with ``"skip"`` (the rest of a broken shard counts as one). After
        :meth:`resume_from`, records trained before the resume are passed over without decoding (and shards with
        nothing left in an epoch not even opened).
        """
        resume = self._resume
        while True:
            epoch, index, passed_over = self._epoch, 0, 0
            for shard in self._epoch_shard_ids(worker, epoch):
                url = self.shards[shard]
                if resume is not None and resume.pass_done(shard, epoch):
                    passed_over += 1
                    continue
                key, in_shard = "(shard start)", 0
                try:
                    for raw, last in _with_last(self._open(url)):
                        key, source = raw.get("__key__", "?"), SampleSource(shard, epoch, in_shard, last)
                        in_shard += 1
                        index += 1
                        if index <= self._consumed:
                            continue  # fast-forward to the resumed position without decoding
                        self._consumed += 1
                        if resume is None or not resume.is_done(shard, epoch, source.index):
                            yield self._record(raw, url, key, source)
                except (tarfile.TarError, OSError, EOFError) as error:
                    index += 1
                    if index > self._consumed:
                        self._consumed += 1
                        if resume is None or not resume.is_done(shard, epoch, in_shard):
                            yield self._bad(url, key, f"unreadable shard after {key}: {error!r}",
                                            SampleSource(shard, epoch, in_shard, last=True))
            if index == 0 and passed_over == 0:
                raise ValueError(f"the shards of data-parallel rank {self.dp_rank} hold no samples")
            self._epoch, self._consumed = epoch + 1, 0

    def _record(self, raw: dict[str, Any], url: str, key: str, source: SampleSource) -> DecodedSample | BadSample:
        try:
            sample = (self.reader(raw) if self.reader is not None else
                      decode_sample(raw, patch_size=self.packing.patch_size, tokenizer=self.tokenizer))
            if not self.decodes_after_plan and self.reader is not None:
                sample = getattr(self.reader, "decode", lambda s: s)(sample)  # a plain stream packs it
            check_packable(sample, self.packing)
        except ValueError as error:
            return self._bad(url, key, str(error), source)
        sample.source = source
        return sample

    def _open(self, url: str) -> Iterator[dict[str, Any]]:
        """The shard's raw samples; a stalled read names this rank as well as the shard."""
        try:
            yield from open_shard(url, read_timeout=self.read_timeout)
        except StalledRead as stall:
            this = f"data-parallel rank {self.dp_rank} of {self.dp_size}"
            if dist.is_available() and dist.is_initialized():  # also in a loader worker: it inherits the rank
                this = f"rank {dist.get_rank()} ({this})"
            raise StalledRead(f"{this}: {stall}") from None

    def _bad(self, shard: str, key: str, reason: str, source: SampleSource) -> BadSample:
        if self.on_bad_sample == "error":
            raise ValueError(f"shard {shard}, sample {key}: {reason}")
        return BadSample(shard, key, reason, source)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.max_batches is not None:
            # A bounded pass (validation) starts over each time and yields the same count on every rank.
            self._epoch, self._consumed = 0, 0
        info = get_worker_info()
        records = self.iter_samples(info.id if info is not None else 0)
        produced = 0
        while self.max_batches is None or produced < self.max_batches:
            samples, consumed = [], []
            while len(samples) < self.batch_size:
                record = next(records)
                consumed.append(record.source)
                if isinstance(record, BadSample):  # counted in this batch's data/skipped
                    log.warning("skipping sample %s of shard %s: %s", record.key, record.shard, record.reason)
                else:
                    samples.append(record)
            batch = pack_samples(samples, self.packing)
            counts = data_counts(samples, [batch], self.packing, skipped=len(consumed) - len(samples))
            if self.max_batches is None:  # training: what the batch consumed, trained as soon as it is
                batch[POSITION_DELTA_KEY] = PositionDelta(read=consumed, trained=consumed)
            yield {**batch, "data": counts}
            produced += 1


class SampleStream(ShardStream):
    """One sample (or :class:`~omni_lightning.data.streaming.BadSample`) at a time, for balancing: media the reader
    left pending are decoded after the plan, by the rank that trains them."""

    decodes_after_plan = True

    @override
    def __iter__(self) -> Any:
        info = get_worker_info()
        return self.iter_samples(info.id if info is not None else 0)
