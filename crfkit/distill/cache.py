"""The teacher-label cache: run a teacher once over a transfer set and keep, per sentence, its
k-best paths, their log-probabilities, log Z and optionally its marginals, in sharded
safetensors files that load lazily, with a manifest recording the teacher, K and the data.

    cache = label_corpus(teacher, sentences, "labels/", k=5,
                         teacher_info={"model": "bert-base-cased-conll", "checkpoint": "sha256:..."})
    batch = cache.batch(ids)                                  # CachedBatch, padded
    loss = crfkit.distill.kbest_cross_entropy(student_emissions, student_transitions,
                                              batch.kbest, batch.lengths)

Teacher
    Any callable ``teacher(list_of_sentences) -> TeacherOutput(emissions (B, L, T),
    transitions (T, T), lengths (B,), start=None, end=None)``; a plain tuple or a mapping with
    those names is accepted too. Sentences are arbitrary items (token lists, strings, ...): the
    cache only indexes ``sentences[i]`` and hashes them. The cache itself calls
    crfkit.kbest_viterbi, crfkit.log_partition and (optionally) crfkit.marginals on the
    teacher's outputs, under torch.no_grad(), on whatever device the emissions live on.
    Batches never straddle shards, so the teacher sees batches of at most ``batch_size``.

On-disk format (format_version 1), one directory:
    manifest.json           format, format_version, teacher (user's description), corpus (user's
                            description), corpus_fingerprint ("sha256:..." of the sentences),
                            num_sentences, k, num_tags, label_names, shard_size, num_shards,
                            with_marginals, marginals_dtype, paths_dtype, float_dtype,
                            config_hash, complete, shards: [{index, file, first_id, end_id,
                            num_sentences, num_tokens, bytes}]
    shard-00017.safetensors sentences [17 * shard_size, 18 * shard_size) (the last shard shorter),
                            in id order, as concatenated ragged arrays:
        ids        int64 (S,)             global sentence ids (index into the corpus)
        offsets    int64 (S + 1,)         sentence j owns tokens offsets[j] .. offsets[j+1]-1
        paths      int8 / int16 / int32   (K * num_tokens,): sentence j's (K, n_j) block of tag
                                          paths, row-major, at K * offsets[j]; -1 marks a missing
                                          row (fewer than K allowed sequences). int8 while
                                          num_tags <= 127, int16 while <= 32767.
        log_probs  float32 (S, K)         -inf on missing rows
        scores     float32 (S, K)         the teacher's path scores (= log_probs + log_z)
        log_z      float32 (S,)           -inf when every sequence is forbidden
        marginals  float16 or float32 (num_tokens, T), only with with_marginals (float16 by
                                          default: probabilities in [0, 1] keep ~3 significant
                                          digits, half the size of float32)
        emissions  float32 (num_tokens, T) only with with_emissions: the teacher's emissions,
        transitions float32 (T, T), start, end float32 (T,): the teacher's CRF (0 where the
                                          teacher has no start / end scores), with_emissions only;
                                          together they give the teacher's whole distribution
                                          (token-level and exact CRF-to-CRF distillation)
        hidden     float16 (num_tokens, H) only with with_hidden: a hidden layer of the teacher
                                          per word (hidden-state distillation)
    and safetensors metadata: format, format_version, config_hash, shard_index, first_id,
    end_id, num_tokens, k, num_tags, rank.
    Scores and probabilities are stored in float32 whatever the teacher's dtype.

Crash safety
    Every file (shard or manifest) is written to a temporary file ``.NAME.tmp-PID-RANDOM`` in the
    same directory, flushed and fsync'ed, then os.replace'd onto its final name (atomic on POSIX),
    and the directory is fsync'ed. So a file with a final shard name is always complete; a kill at
    any point leaves at most a temporary file, which never matches a shard name, is ignored, and
    is deleted when the labelling resumes. Shard i always holds the fixed id range
    [i * shard_size, (i + 1) * shard_size), so on resume the missing shards are exactly the
    missing sentences: nothing is labelled twice, nothing is lost. The manifest is written first
    (complete = false) with everything a resume must match (K, teacher, corpus fingerprint,
    shard size, marginals); a resume that asks for something else is refused with a
    CacheMismatchError naming the differences. After the last shard the manifest is rewritten
    with complete = true and the shard list. Only one labelling job may write to a directory at a
    time (the ranks of one torchrun job count as one): label_corpus holds an flock on
    .label_corpus.lock from start to finish (the kernel releases it when the process dies, so a
    kill leaves no stale lock), and a second job is refused with a CacheBusyError naming the first
    (pid, host, command, start time, from .label_corpus.writer.json). A complete cache that
    matches the request is opened without the lock, so many jobs can read it at once.

torchrun / torch.distributed
    If torch.distributed is initialised, or RANK and WORLD_SIZE (> 1) are set in the environment
    (torchrun sets them; the cache then initialises a gloo process group itself from the env://
    variables and destroys it before returning), the ranks share the work: rank 0 checks the
    directory and lists the missing shards, every rank takes every world_size-th of that list
    (shards i with i % world_size == rank on a fresh run), and after a barrier rank 0 writes the
    final manifest. Coordination runs on a dedicated gloo group (CPU; works whatever the default
    backend), with a long timeout (``dist_timeout``, default 24 h) because ranks wait at the
    barrier for the slowest one. The directory must be visible to every rank (shared filesystem).
    Every rank returns the same TeacherLabelCache. Progress (tqdm) is shown by rank 0 only.

Runtime dependencies: torch, numpy, safetensors, tqdm.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import operator
import os
import platform
import re
import sys
import warnings
from collections import OrderedDict
from datetime import datetime, timedelta
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as _safetensors_save
from torch import Tensor

from .._files import atomic_write
from .._validation import check_int
from ..functional import KBest, kbest_viterbi, log_partition, marginals

__all__ = [
    "CacheBusyError",
    "CacheMismatchError",
    "CacheUnion",
    "CachedBatch",
    "CachedLabels",
    "TeacherLabelCache",
    "TeacherOutput",
    "corpus_fingerprint",
    "label_corpus",
    "load_cache",
]

FORMAT = "crfkit-teacher-labels"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WRITER_LOCK = ".label_corpus.lock"        # held (flock) by the one job labelling the directory
WRITER_INFO = ".label_corpus.writer.json"  # who holds it: pid, host, command, start time
DEFAULT_SHARD_SIZE = 1024
_SHARD_RE = re.compile(r"^shard-(\d+)\.safetensors$")
_TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-z]+-[0-9a-f]+$")
_MARGINAL_DTYPES = {torch.float16: "float16", torch.float32: "float32"}
_FLOAT_DTYPE = torch.float32
_HIDDEN_DTYPE = torch.float16  # hidden states are wide (hundreds per word): half the bytes of float32
_FINGERPRINT_CHUNK = 4096


class TeacherOutput(NamedTuple):
    """What a teacher returns for a batch of B sentences: emissions (B, L, T), transitions (T, T),
    lengths (B,) (None: all L), start / end (T,) or None, and hidden (B, L, H) or None: one of its
    hidden layers per word (needed by label_corpus(..., with_hidden=True) only)."""

    emissions: Tensor
    transitions: Tensor
    lengths: Optional[Tensor]
    start: Optional[Tensor] = None
    end: Optional[Tensor] = None
    hidden: Optional[Tensor] = None


class CachedLabels(NamedTuple):
    """One sentence's cached teacher labels (n = its length, K = the cache's k, T = num_tags).

    id         int                  global sentence id (index into the corpus)
    paths      (K, n) int64         k-best tag paths, best first; a missing row is all -1
    log_probs  (K,) float32         log p(path | x); -inf on missing rows
    scores     (K,) float32         the teacher's path scores s(x, path)
    log_z      () float32           the teacher's log Z(x)
    marginals  (n, T) or None       teacher marginals, float16 or float32 as stored
    emissions  (n, T) or None       teacher emissions (float32), with_emissions only
    hidden     (n, H) or None       a teacher hidden layer (float16), with_hidden only
    """

    id: int
    paths: Tensor
    log_probs: Tensor
    scores: Tensor
    log_z: Tensor
    marginals: Optional[Tensor]
    emissions: Optional[Tensor] = None
    hidden: Optional[Tensor] = None


class CachedBatch(NamedTuple):
    """A padded batch of cached labels (B sentences, padded to length L).

    ids        (B,) int64
    kbest      crfkit.KBest(scores (B, K), paths (B, K, L) int64 with -1 padding, log_probs (B, K)),
               what crfkit.kbest_viterbi returns for the same teacher outputs
    lengths    (B,) int64
    log_z      (B,)
    marginals  (B, L, T) (zero at padded positions) or None
    emissions  (B, L, T) teacher emissions (zero at padded positions) or None
    hidden     (B, L, H) a teacher hidden layer (zero at padded positions) or None
    """

    ids: Tensor
    kbest: KBest
    lengths: Tensor
    log_z: Tensor
    marginals: Optional[Tensor]
    emissions: Optional[Tensor] = None
    hidden: Optional[Tensor] = None


class CacheMismatchError(ValueError):
    """A directory holds teacher labels of a different run (another K, teacher, corpus, ...)."""


class CacheBusyError(RuntimeError):
    """Another job is labelling the directory (label_corpus holds its writer lock)."""


# --------------------------------------------------------------------------- fingerprints


def _encode_item(item: Any) -> bytes:
    if isinstance(item, bytes):
        return b"b" + item
    if isinstance(item, str):
        return b"s" + item.encode("utf-8")
    if isinstance(item, Tensor):
        t = item.detach().cpu().contiguous()
        head = f"t{t.dtype}{tuple(t.shape)}".encode()
        return head + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    try:
        return b"j" + json.dumps(item, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError):
        return b"r" + repr(item).encode("utf-8")


def corpus_fingerprint(sentences: Sequence) -> str:
    """"sha256:<hex>" of the number of sentences and every sentence in order.

    Strings, bytes, tensors and JSON-serialisable items (lists of tokens, dicts, ...) are hashed
    by value; anything else by repr(). For items whose repr does not show their whole value, pass
    your own ``corpus_fingerprint=`` to label_corpus.
    """
    h = hashlib.sha256()
    n = len(sentences)
    h.update(f"{FORMAT} corpus {n} chunks {_FINGERPRINT_CHUNK}\n".encode())
    for first in range(0, n, _FINGERPRINT_CHUNK):
        items = [sentences[i] for i in range(first, min(n, first + _FINGERPRINT_CHUNK))]
        try:  # one C-encoder call per chunk: ~10x faster than an item at a time
            encoded = b"J" + json.dumps(items, ensure_ascii=False, sort_keys=True,
                                        separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError):
            encoded = b"I" + b"".join(len(e).to_bytes(8, "little") + e for e in map(_encode_item, items))
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
    return "sha256:" + h.hexdigest()


_corpus_fingerprint = corpus_fingerprint  # label_corpus's argument of that name shadows it


def _normalise_json(value: Any, name: str) -> Any:
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be JSON-serialisable (a string or a dict of strings / numbers), "
                        f"got {type(value).__name__}: {error}") from None


def _config_hash(config: Mapping) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- files


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _scan_shards(directory: str) -> dict:
    found = {}
    for name in os.listdir(directory):
        match = _SHARD_RE.match(name)
        if match:
            found[int(match.group(1))] = name
    return found


def _read_manifest(directory: str) -> Optional[dict]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); it was not written by crfkit's cache") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a crfkit teacher-label manifest (format = {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {manifest.get('format_version')}; this crfkit reads "
                         f"version {FORMAT_VERSION}")
    return manifest


def _write_manifest(directory: str, manifest: Mapping) -> None:
    data = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n"
    atomic_write(os.path.join(directory, MANIFEST), data)


def _paths_dtype(num_tags: int) -> torch.dtype:
    if num_tags <= 127:
        return torch.int8
    if num_tags <= 32767:
        return torch.int16
    return torch.int32


# --------------------------------------------------------------------------- distributed


class _Distributed:
    """Rank / world size and a gloo group for coordination; a no-op with one process."""

    def __init__(self, distributed: Optional[bool], timeout: timedelta):
        self.rank, self.world_size, self.group = 0, 1, None
        self._owns_default = False
        if distributed is False:
            return
        import torch.distributed as dist

        self._dist = dist
        env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if dist.is_available() and dist.is_initialized():
            pass
        elif dist.is_available() and env_world > 1 and "RANK" in os.environ:
            dist.init_process_group(backend="gloo", init_method="env://", timeout=timeout)
            self._owns_default = True
        elif distributed:
            raise RuntimeError("label_corpus(distributed=True) needs torch.distributed initialised, or RANK / "
                               "WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (run it under torchrun)")
        else:
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size > 1:
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def broadcast(self, value):
        """value from rank 0 (what the other ranks pass is ignored)."""
        if self.world_size == 1:
            return value
        box = [value]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather(self, value) -> list:
        if self.world_size == 1:
            return [value]
        out = [None] * self.world_size
        self._dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            self._dist.barrier(group=self.group)

    def close(self) -> None:
        if self.group is not None:
            self._dist.destroy_process_group(self.group)
            self.group = None
        if self._owns_default:
            self._dist.destroy_process_group()
            self._owns_default = False


def _on_rank0(ctx: _Distributed, function: Callable[[], Any]):
    """Run function on rank 0 and give every rank its result, or raise its error on every rank."""
    outcome = None
    if ctx.rank == 0:
        try:
            outcome = ("ok", function())
        except Exception as error:  # noqa: BLE001 - every rank must learn of it, or they would hang
            if ctx.world_size == 1:
                raise
            outcome = ("error", type(error).__name__, str(error))
    outcome = ctx.broadcast(outcome)
    if outcome[0] == "error":
        kinds = {"CacheMismatchError": CacheMismatchError, "CacheBusyError": CacheBusyError,
                 "ValueError": ValueError, "TypeError": TypeError}
        raise kinds.get(outcome[1], RuntimeError)(f"{outcome[2]} (raised on rank 0)" if ctx.rank else outcome[2])
    return outcome[1]


# --------------------------------------------------------------------------- the writer lock


def _lock_for_writing(directory: str):
    """Take the directory's writer lock, or raise CacheBusyError naming the job that holds it.

    filelock's FileLock is an flock on POSIX: the kernel drops it when its process ends, however
    it ends (a SIGKILL included), so a killed job never leaves a stale lock behind. Without the
    lock, a second job would delete the first one's temporary shard files (see Crash safety)."""
    import filelock

    lock = filelock.FileLock(os.path.join(directory, WRITER_LOCK), thread_local=False)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        raise CacheBusyError(f"{directory} is being labelled by another job ({_describe_writer(directory)}); "
                             "one labelling job per directory: wait for it to finish (then this call resumes or "
                             "returns its cache), or label into another directory") from None
    writer = {"pid": os.getpid(), "host": platform.node(), "command": " ".join(sys.argv) or sys.executable,
              "started": datetime.now().isoformat(timespec="seconds")}
    atomic_write(os.path.join(directory, WRITER_INFO), json.dumps(writer).encode("utf-8"))
    return lock


def _describe_writer(directory: str) -> str:
    try:
        with open(os.path.join(directory, WRITER_INFO), encoding="utf-8") as f:
            writer = json.load(f)
        return f"pid {writer['pid']} on {writer['host']}, started {writer['started']}: {writer['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its details are not written yet"


# --------------------------------------------------------------------------- labelling


def _as_teacher_output(out: Any) -> TeacherOutput:
    if isinstance(out, TeacherOutput):
        return out
    if isinstance(out, Mapping):
        return TeacherOutput(**out)
    if isinstance(out, (tuple, list)) and 3 <= len(out) <= 6:
        return TeacherOutput(*out)
    raise TypeError("teacher(batch) must return a TeacherOutput(emissions, transitions, lengths, start=None, "
                    f"end=None, hidden=None) (or a tuple / mapping of those), got {type(out).__name__}")


def _label_batch(teacher, items: list, k: int, with_marginals: bool, with_emissions: bool = False,
                 with_hidden: bool = False) -> dict:
    """Teacher outputs for one batch -> the batch's ragged arrays (CPU)."""
    with torch.no_grad():
        out = _as_teacher_output(teacher(items))
        emissions, transitions, lengths, start, end, hidden = out
        if not isinstance(emissions, Tensor) or emissions.dim() != 3:
            raise ValueError("the teacher's emissions must be a (batch, seq_len, num_tags) tensor, got "
                             f"{tuple(emissions.shape) if isinstance(emissions, Tensor) else type(emissions).__name__}")
        B, L, T = emissions.shape
        if B != len(items):
            raise ValueError(f"the teacher returned emissions for {B} sentences for a batch of {len(items)}")
        if with_hidden and (not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (B, L)):
            raise ValueError(f"with_hidden=True needs the teacher's hidden states, a ({B}, {L}, hidden_size) tensor "
                             "(TeacherOutput.hidden), got "
                             f"{tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}")
        if lengths is None:
            lengths = torch.full((B,), L, dtype=torch.long, device=emissions.device)
        kb = kbest_viterbi(emissions, transitions, k, lengths, start, end)
        log_z = log_partition(emissions, transitions, lengths, start, end)
        margs = marginals(emissions, transitions, lengths, start, end) if with_marginals else None
    lengths = lengths.detach().to("cpu", torch.long)
    real = np.arange(L) < lengths.numpy()[:, None]                     # (B, L)
    # Boolean indexing reads row-major (b, k, i): sentence b's (K, n_b) block, contiguous.
    # numpy's, single-threaded, is several times faster than torch's here on a busy machine.
    paths = torch.from_numpy(kb.paths.cpu().numpy()[np.broadcast_to(real[:, None, :], (B, k, L))])
    batch = {
        "num_tags": T,
        "lengths": lengths,
        "paths": paths,
        "log_probs": kb.log_probs.detach().to("cpu", _FLOAT_DTYPE),
        "scores": kb.scores.detach().to("cpu", _FLOAT_DTYPE),
        "log_z": log_z.detach().to("cpu", _FLOAT_DTYPE),
    }
    if margs is not None:
        batch["marginals"] = torch.from_numpy(margs.detach().cpu().numpy()[real])   # (sum n_b, T)
    if with_emissions:
        batch["emissions"] = torch.from_numpy(emissions.detach().to("cpu", _FLOAT_DTYPE).numpy()[real])
        batch["crf"] = {"transitions": transitions.detach().to("cpu", _FLOAT_DTYPE),
                        "start": (torch.zeros(T) if start is None else start.detach()).to("cpu", _FLOAT_DTYPE),
                        "end": (torch.zeros(T) if end is None else end.detach()).to("cpu", _FLOAT_DTYPE)}
    if with_hidden:
        batch["hidden"] = torch.from_numpy(hidden.detach().to("cpu", _HIDDEN_DTYPE).numpy()[real])
    return batch


def _shard_bytes(batches: List[dict], first_id: int, end_id: int, metadata: dict,
                 paths_dtype: torch.dtype, marginals_dtype: Optional[torch.dtype]) -> bytes:
    lengths = torch.cat([b["lengths"] for b in batches])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=offsets[1:])
    tensors = {
        "ids": torch.arange(first_id, end_id, dtype=torch.long),
        "offsets": offsets,
        "paths": torch.cat([b["paths"] for b in batches]).to(paths_dtype),
        "log_probs": torch.cat([b["log_probs"] for b in batches]),
        "scores": torch.cat([b["scores"] for b in batches]),
        "log_z": torch.cat([b["log_z"] for b in batches]),
    }
    if marginals_dtype is not None:
        tensors["marginals"] = torch.cat([b["marginals"] for b in batches]).to(marginals_dtype)
    if "emissions" in batches[0]:
        tensors["emissions"] = torch.cat([b["emissions"] for b in batches])
        # a shard stores one CRF: every batch of it must come from the same teacher
        crf = batches[0]["crf"]
        for b in batches[1:]:
            if any(not torch.equal(crf[name], b["crf"][name]) for name in crf):
                raise CacheMismatchError(f"sentences [{first_id}, {end_id}) of one shard got CRFs of different "
                                         "teachers; label each teacher's sentences into a cache of their own and "
                                         "join them with CacheUnion")
        tensors.update(crf)
    if "hidden" in batches[0]:
        tensors["hidden"] = torch.cat([b["hidden"] for b in batches])
    metadata = dict(metadata, num_tokens=str(int(offsets[-1])))
    return _safetensors_save({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)


def _shard_header(path: str) -> dict:
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def label_corpus(
    teacher: Callable[[list], Any],
    sentences: Sequence,
    directory: str,
    k: int,
    *,
    batch_size: int = 32,
    shard_size: Optional[int] = None,
    teacher_info: Any = None,
    corpus_info: Any = None,
    label_names: Optional[Sequence[str]] = None,
    with_marginals: bool = False,
    marginals_dtype: torch.dtype = torch.float16,
    with_emissions: bool = False,
    with_hidden: bool = False,
    progress: bool = True,
    corpus_fingerprint: Optional[str] = None,
    distributed: Optional[bool] = None,
    dist_timeout: timedelta = timedelta(hours=24),
    max_open_shards: int = 8,
) -> "TeacherLabelCache":
    """Label ``sentences`` with ``teacher`` into ``directory`` (created if needed) and return the
    cache; resumes a previous run in the same directory, or returns at once if it is complete.

    teacher         callable(list of sentences) -> TeacherOutput (see the module docstring)
    sentences       a Sequence (len() and [i]); sentence ids are indices into it
    k               paths kept per sentence
    batch_size      sentences per teacher call (batches never straddle shards)
    shard_size      sentences per shard file; None: the existing cache's, else 1024
    teacher_info    JSON-serialisable description of the teacher (model name, checkpoint hash):
                    recorded in the manifest; a resume with another one is refused
    corpus_info     JSON-serialisable description of the corpus, recorded and checked likewise
    label_names     optional tag names (len = num_tags), recorded and checked likewise
    with_marginals  also store the teacher's marginals (num_tokens, T) in marginals_dtype
                    (torch.float16, the default, or torch.float32)
    with_emissions  also store the teacher's emissions (num_tokens, T) and its transitions /
                    start / end (float32): the teacher's whole CRF, for token-level and exact
                    CRF-to-CRF losses (TeacherLabelCache.teacher_crf(), CachedBatch.emissions)
    with_hidden     also store the teacher's hidden states per word (num_tokens, H) in float16
                    (TeacherOutput.hidden; CachedBatch.hidden), for hidden-state distillation
    corpus_fingerprint  your own fingerprint of the corpus (default: corpus_fingerprint(sentences))
    distributed     None: split across ranks when torch.distributed is initialised or RANK /
                    WORLD_SIZE are set; False: never; True: require it
    Raises CacheMismatchError if the directory holds labels of another K / teacher / corpus /
    shard size / marginals setting, and CacheBusyError (at once, without waiting) while another
    job is labelling the directory.
    """
    check_int("k", k, minimum=1, type_error=ValueError)
    check_int("batch_size", batch_size, minimum=1, type_error=ValueError)
    check_int("shard_size", shard_size, minimum=1, optional=True, type_error=ValueError)
    if with_marginals and marginals_dtype not in _MARGINAL_DTYPES:
        raise ValueError(f"marginals_dtype must be torch.float16 or torch.float32, got {marginals_dtype}")
    if not hasattr(sentences, "__len__") or not hasattr(sentences, "__getitem__"):
        raise TypeError(f"sentences must be a Sequence (len() and indexing), got {type(sentences).__name__}")
    if not callable(teacher):
        raise TypeError(f"teacher must be callable, got {type(teacher).__name__}")
    teacher_info = _normalise_json(teacher_info, "teacher_info")
    corpus_info = _normalise_json(corpus_info, "corpus_info")
    if label_names is not None:
        label_names = [str(name) for name in label_names]
    directory = os.fspath(directory)
    num_sentences = len(sentences)

    ctx = _Distributed(distributed, dist_timeout)
    lock = None  # rank 0's writer lock, held until the manifest is final
    try:
        fingerprint = corpus_fingerprint if corpus_fingerprint is not None else _corpus_fingerprint(sentences)
        seen = ctx.all_gather((num_sentences, fingerprint))
        if len(set(seen)) != 1:
            raise ValueError(f"the ranks were given different corpora: (num_sentences, fingerprint) per rank = {seen}")

        request = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "k": k,
            "teacher": teacher_info,
            "corpus": corpus_info,
            "corpus_fingerprint": fingerprint,
            "num_sentences": num_sentences,
            "label_names": label_names,
            "with_marginals": bool(with_marginals),
            "marginals_dtype": _MARGINAL_DTYPES[marginals_dtype] if with_marginals else None,
        }
        if with_emissions:  # recorded only when on, so caches written before the option keep their hash
            request["with_emissions"] = True
        if with_hidden:
            request["with_hidden"] = True
        def lock_and_prepare():
            nonlocal lock
            # A finished cache is only read: no lock, so any number of jobs (the seeds of one
            # study, say) can open it at once. Anything else needs the writer.
            finished = _prepare_directory(directory, request, shard_size, read_only=True)
            if finished is not None:
                return finished
            os.makedirs(directory, exist_ok=True)
            lock = _lock_for_writing(directory)
            return _prepare_directory(directory, request, shard_size)

        plan = _on_rank0(ctx, lock_and_prepare)
        if plan["missing"]:
            _label_shards(teacher, sentences, directory, plan, ctx, batch_size, progress)
        if plan["missing"] or not plan["complete"]:
            ctx.barrier()
            _on_rank0(ctx, lambda: _finalise(directory, plan))
        return TeacherLabelCache(directory, max_open_shards=max_open_shards)
    finally:
        if lock is not None:
            try:
                os.unlink(os.path.join(directory, WRITER_INFO))
            except OSError:
                pass
            lock.release()
        ctx.close()


def _prepare_directory(directory: str, request: dict, shard_size: Optional[int], read_only: bool = False):
    """Rank 0, before any shard is written: check / create the manifest, delete leftover
    temporary files, list the shards that exist and the ones still missing.

    read_only: write nothing (no lock is held) and return the plan only for a complete cache
    that matches the request with every shard readable; None when a writer is needed."""
    if read_only:
        manifest = _read_manifest(directory) if os.path.isdir(directory) else None
        if manifest is None or not manifest.get("complete"):
            return None
    else:
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):
            if _TMP_RE.match(name):  # a write that was killed before its os.replace
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:
                    pass
        manifest = _read_manifest(directory)
    existing = _scan_shards(directory)
    if manifest is None:
        if existing:
            raise CacheMismatchError(f"{directory} holds shard files but no {MANIFEST}: it was not written by "
                                     "label_corpus (or its manifest was deleted); use an empty directory")
        shard_size = shard_size or DEFAULT_SHARD_SIZE
    elif not existing and not manifest.get("complete"):
        manifest = None  # an earlier run stopped before its first shard: nothing to mix, start afresh
        shard_size = shard_size or DEFAULT_SHARD_SIZE
    else:
        asked = dict(request, shard_size=shard_size or manifest.get("shard_size"))
        asked.setdefault("with_emissions", None)  # absent when off (see label_corpus)
        asked.setdefault("with_hidden", None)
        differences = [f"{key}: the cache has {manifest.get(key)!r}, this run asks for {value!r}"
                       for key, value in asked.items() if manifest.get(key) != value]
        if differences:
            raise CacheMismatchError(
                f"{directory} holds teacher labels of a different run, refusing to mix them:\n  "
                + "\n  ".join(differences)
                + "\nUse another directory, or delete this one to relabel.")
        shard_size = manifest["shard_size"]
    config = dict(request, shard_size=shard_size)
    config_hash = _config_hash(config)
    num_shards = math.ceil(request["num_sentences"] / shard_size)
    if manifest is None:
        manifest = dict(config, config_hash=config_hash, num_shards=num_shards, num_tags=None, paths_dtype=None,
                        float_dtype="float32", complete=False, shards=[])
        _write_manifest(directory, manifest)

    num_tags = set()
    present = []
    for index, name in sorted(existing.items()):
        path = os.path.join(directory, name)
        try:
            header = _shard_header(path)
        except Exception as error:  # noqa: BLE001 - any unreadable header
            if read_only:
                return None  # the writer deletes and relabels it
            warnings.warn(f"{path} is unreadable ({error}); deleting it and labelling its sentences again")
            os.unlink(path)
            continue
        if header.get("config_hash") != config_hash or index >= num_shards:
            raise CacheMismatchError(f"{path} was written by a different labelling run (config_hash "
                                     f"{header.get('config_hash')!r}, expected {config_hash!r}); refusing to mix them")
        num_tags.add(int(header["num_tags"]))
        present.append(index)
    if len(num_tags) > 1:
        raise CacheMismatchError(f"the shards in {directory} disagree on num_tags: {sorted(num_tags)}")
    missing = sorted(set(range(num_shards)) - set(present))
    if read_only and missing:
        return None
    if manifest.get("complete") and missing:
        warnings.warn(f"{directory}: the manifest says complete but {len(missing)} shard(s) are missing; "
                      "labelling them again")
    return {
        "config": config,
        "config_hash": config_hash,
        "num_shards": num_shards,
        "num_tags": num_tags.pop() if num_tags else manifest.get("num_tags"),
        "missing": missing,
        "complete": bool(manifest.get("complete")) and not missing,
    }


def _label_shards(teacher, sentences, directory, plan, ctx, batch_size, progress) -> None:
    from tqdm.auto import tqdm

    config = plan["config"]
    k, shard_size, n = config["k"], config["shard_size"], config["num_sentences"]
    mine = plan["missing"][ctx.rank::ctx.world_size]
    marginals_dtype = {v: d for d, v in _MARGINAL_DTYPES.items()}.get(config["marginals_dtype"])
    num_tags = plan["num_tags"]
    label_names = config["label_names"]
    total = sum(min(n, (i + 1) * shard_size) - i * shard_size for i in mine)
    desc = "teacher labels" + (f" (rank 0 of {ctx.world_size})" if ctx.world_size > 1 else "")
    with tqdm(total=total, desc=desc, unit="sent", disable=not progress or ctx.rank != 0, dynamic_ncols=True) as bar:
        for index in mine:
            first, end = index * shard_size, min(n, (index + 1) * shard_size)
            batches = []
            for lo in range(first, end, batch_size):
                hi = min(end, lo + batch_size)
                batch = _label_batch(teacher, [sentences[i] for i in range(lo, hi)], k, config["with_marginals"],
                                     config.get("with_emissions", False), config.get("with_hidden", False))
                T = batch["num_tags"]
                if num_tags is None:
                    if label_names is not None and len(label_names) != T:
                        raise ValueError(f"label_names has {len(label_names)} names but the teacher has {T} tags")
                    num_tags = T
                elif T != num_tags:
                    raise CacheMismatchError(f"the teacher gives {T} tags but the cache in {directory} holds "
                                             f"{num_tags}; refusing to mix them")
                batches.append(batch)
                bar.update(hi - lo)
            metadata = {
                "format": FORMAT,
                "format_version": str(FORMAT_VERSION),
                "config_hash": plan["config_hash"],
                "shard_index": str(index),
                "first_id": str(first),
                "end_id": str(end),
                "k": str(k),
                "num_tags": str(num_tags),
                "rank": str(ctx.rank),
            }
            data = _shard_bytes(batches, first, end, metadata, _paths_dtype(num_tags), marginals_dtype)
            atomic_write(os.path.join(directory, _shard_name(index)), data)


def _finalise(directory: str, plan: dict) -> None:
    """Rank 0, after every rank's shards are written: check them, write the complete manifest."""
    config = plan["config"]
    shard_size, n = config["shard_size"], config["num_sentences"]
    existing = _scan_shards(directory)
    missing = [i for i in range(plan["num_shards"]) if i not in existing]
    if missing:
        raise RuntimeError(f"{directory}: shards {missing[:10]}{'...' if len(missing) > 10 else ''} are missing "
                           "after labelling; run label_corpus again to resume")
    shards, num_tags = [], set()
    for index in range(plan["num_shards"]):
        path = os.path.join(directory, existing[index])
        header = _shard_header(path)
        first, end = index * shard_size, min(n, (index + 1) * shard_size)
        if (header.get("config_hash") != plan["config_hash"] or int(header["first_id"]) != first
                or int(header["end_id"]) != end):
            raise CacheMismatchError(f"{path} does not hold sentences [{first}, {end}) of this run")
        num_tags.add(int(header["num_tags"]))
        shards.append({"index": index, "file": existing[index], "first_id": first, "end_id": end,
                       "num_sentences": end - first, "num_tokens": int(header["num_tokens"]),
                       "bytes": os.path.getsize(path)})
    if len(num_tags) > 1:
        raise CacheMismatchError(f"the shards in {directory} disagree on num_tags: {sorted(num_tags)}")
    T = num_tags.pop() if num_tags else plan["num_tags"]
    manifest = dict(config, config_hash=plan["config_hash"], num_shards=plan["num_shards"], num_tags=T,
                    paths_dtype=str(_paths_dtype(T)).replace("torch.", "") if T is not None else None,
                    float_dtype="float32", complete=True, shards=shards)
    _write_manifest(directory, manifest)


# --------------------------------------------------------------------------- reading


class _Shard:
    """One open shard: the small arrays in memory, marginals read on demand (memory-mapped).

    Opening checks that the file is this cache's shard `index` (its metadata: format, config_hash,
    shard index and id range, K, num_tags) and that its arrays fit together, so a shard copied in
    from another cache is a CacheMismatchError and a damaged one a ValueError, each naming the file."""

    def __init__(self, path: str, manifest: Mapping, index: int, first_id: int, end_id: int):
        from safetensors import SafetensorError

        k, num_tags = manifest["k"], manifest["num_tags"]
        try:
            handle = safe_open(path, framework="pt")
            header = dict(handle.metadata() or {})
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is not a readable shard ({error}); the cache is damaged: delete the file and "
                             "run label_corpus again with the same arguments to relabel its sentences") from None
        expected = {"format": FORMAT, "config_hash": manifest.get("config_hash"), "shard_index": str(index),
                    "first_id": str(first_id), "end_id": str(end_id), "k": str(k), "num_tags": str(num_tags)}
        if num_tags is None:  # an unfinished cache's manifest has no num_tags yet
            del expected["num_tags"]
        differences = [f"{key} {header.get(key)!r} (expected {value!r})" for key, value in expected.items()
                       if header.get(key) != value]
        if differences:
            raise CacheMismatchError(f"{path} is not shard {index} of the cache in {os.path.dirname(path)}: "
                                     f"{', '.join(differences)}; it was copied from another labelling run")
        try:
            ids = handle.get_tensor("ids")
            self.offsets = handle.get_tensor("offsets").tolist()
            self.paths = handle.get_tensor("paths")
            self.log_probs = handle.get_tensor("log_probs")
            self.scores = handle.get_tensor("scores")
            self.log_z = handle.get_tensor("log_z")
            # the marginals (the bulk of a shard) stay on disk, memory-mapped, sliced per sentence
            self.marginals = handle.get_slice("marginals") if "marginals" in handle.keys() else None
            self.emissions = handle.get_slice("emissions") if "emissions" in handle.keys() else None
            self.hidden = handle.get_slice("hidden") if "hidden" in handle.keys() else None
            self.crf = ({name: handle.get_tensor(name) for name in ("transitions", "start", "end")}
                        if "transitions" in handle.keys() else None)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is damaged ({error}): delete it and run label_corpus again to relabel "
                             "its sentences") from None
        S = end_id - first_id
        tokens = self.offsets[-1] if len(self.offsets) == S + 1 else None
        consistent = (
            ids.tolist() == list(range(first_id, end_id)) and tokens is not None
            and tokens == int(header.get("num_tokens", -1)) and tuple(self.paths.shape) == (k * tokens,)
            and all(tuple(t.shape) == shape for t, shape in ((self.log_probs, (S, k)), (self.scores, (S, k)),
                                                              (self.log_z, (S,))))
            and all(tuple(part.get_shape())[:1] == (tokens,) for part in (self.marginals, self.emissions, self.hidden)
                    if part is not None))
        if not consistent:
            raise ValueError(f"{path} does not hold sentences [{first_id}, {end_id}) consistently (its arrays "
                             "disagree in size); the cache is damaged: delete the file and run label_corpus again")
        self.first_id, self.k = first_id, k

    def record(self, sentence_id: int) -> CachedLabels:
        j = sentence_id - self.first_id
        begin, end = self.offsets[j], self.offsets[j + 1]
        paths = self.paths[self.k * begin:self.k * end].view(self.k, end - begin).to(torch.long)
        margs = self.marginals[begin:end] if self.marginals is not None else None
        emissions = self.emissions[begin:end] if self.emissions is not None else None
        hidden = self.hidden[begin:end] if self.hidden is not None else None
        return CachedLabels(sentence_id, paths, self.log_probs[j], self.scores[j], self.log_z[j], margs, emissions,
                            hidden)


def _sentence_index(sentence_id, n: int) -> int:
    """sentence_id as an index into n sentences (negative ids count from the end); IndexError
    outside."""
    i = operator.index(sentence_id)
    i = i + n if i < 0 else i
    if not 0 <= i < n:
        raise IndexError(f"sentence id {sentence_id} out of range for a cache of {n} sentences")
    return i


def _pad_per_token(values: Sequence[Optional[Tensor]], L: int, dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """B per-token (n_b, T) tensors -> (B, L, T), zero past each n_b; None if any is None."""
    if not values or any(v is None for v in values):
        return None
    out = torch.zeros((len(values), L, values[0].shape[1]), dtype=dtype or values[0].dtype)
    for b, v in enumerate(values):
        out[b, :v.shape[0]] = v
    return out


class TeacherLabelCache:
    """A labelled corpus on disk, read lazily: only the manifest is read when it is opened; a
    shard is opened at the first request of one of its sentences, and at most
    ``max_open_shards`` stay open (least recently used closed first).

    len(cache), cache[sentence_id] -> CachedLabels, iteration in id order; a map-style dataset
    for torch.utils.data.DataLoader with ``collate_fn=TeacherLabelCache.collate``.
    ``allow_incomplete=True`` opens a cache whose labelling has not finished (sentences of
    missing shards raise KeyError). Each shard is checked when it is opened: one copied from
    another labelling run raises CacheMismatchError, a damaged or truncated one ValueError, both
    naming the file.
    """

    def __init__(self, directory: str, *, max_open_shards: int = 8, allow_incomplete: bool = False):
        self.directory = os.fspath(directory)
        manifest = _read_manifest(self.directory)
        if manifest is None:
            raise FileNotFoundError(f"{os.path.join(self.directory, MANIFEST)} does not exist: "
                                    "not a teacher-label cache")
        if not manifest["complete"] and not allow_incomplete:
            raise ValueError(f"the teacher-label cache in {self.directory} is incomplete (labelling was interrupted); "
                             "run label_corpus again to finish it, or pass allow_incomplete=True")
        check_int("max_open_shards", max_open_shards, minimum=1)
        self.manifest = manifest
        self.max_open_shards = max_open_shards
        if manifest["complete"]:
            self._files = {entry["index"]: entry["file"] for entry in manifest["shards"]}
        else:
            self._files = _scan_shards(self.directory)
        self._open: "OrderedDict[int, _Shard]" = OrderedDict()

    k = property(lambda self: self.manifest["k"], doc="paths per sentence")
    num_tags = property(lambda self: self.manifest["num_tags"], doc="the teacher's number of tags")
    label_names = property(lambda self: self.manifest["label_names"], doc="tag names, or None")
    teacher_info = property(lambda self: self.manifest["teacher"], doc="the teacher's description")
    corpus_info = property(lambda self: self.manifest["corpus"], doc="the corpus's description")
    complete = property(lambda self: self.manifest["complete"], doc="labelling finished")
    shard_size = property(lambda self: self.manifest["shard_size"], doc="sentences per shard")

    def __len__(self) -> int:
        return self.manifest["num_sentences"]

    def __repr__(self) -> str:
        return (f"TeacherLabelCache({self.directory!r}, sentences={len(self)}, k={self.k}, num_tags={self.num_tags}, "
                f"shards={self.manifest['num_shards']}, marginals={self.manifest['with_marginals']})")

    def _shard(self, index: int) -> _Shard:
        shard = self._open.get(index)
        if shard is not None:
            self._open.move_to_end(index)
            return shard
        name = self._files.get(index)
        if name is None:
            raise KeyError(f"shard {index} of {self.directory} has not been labelled yet")
        first = index * self.shard_size
        shard = _Shard(os.path.join(self.directory, name), self.manifest, index, first,
                       min(len(self), first + self.shard_size))
        self._open[index] = shard
        while len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return shard

    def __getitem__(self, sentence_id) -> CachedLabels:
        i = _sentence_index(sentence_id, len(self))
        return self._shard(i // self.shard_size).record(i)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def batch(self, ids, pad_to: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> CachedBatch:
        """Records ids (an iterable of ints or a 1-D tensor) -> a padded CachedBatch."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self.collate([self[i] for i in ids], pad_to=pad_to, dtype=dtype)

    @staticmethod
    def collate(records: Sequence[CachedLabels], pad_to: Optional[int] = None,
                dtype: Optional[torch.dtype] = None) -> CachedBatch:
        """CachedLabels records -> CachedBatch padded to length pad_to (default: the longest).

        kbest.paths (B, K, L) int64 with -1 at padded positions and on missing rows, kbest.scores /
        kbest.log_probs (B, K), lengths (B,), log_z (B,), marginals (B, L, T) or None;
        floats are float32 unless dtype is given (marginals keep their stored dtype unless dtype is given).
        """
        B = len(records)
        if B == 0:
            raise ValueError("collate needs at least one record")
        K = records[0].paths.shape[0]
        lengths = torch.tensor([r.paths.shape[1] for r in records], dtype=torch.long)
        longest = int(lengths.max())
        L = longest if pad_to is None else int(pad_to)
        if L < longest:
            raise ValueError(f"pad_to = {pad_to} is shorter than the longest sentence of the batch ({longest})")
        paths = torch.full((B, K, L), -1, dtype=torch.long)
        for b, r in enumerate(records):
            if r.paths.shape[0] != K:
                raise ValueError(f"records with different K: {K} and {r.paths.shape[0]}")
            paths[b, :, :r.paths.shape[1]] = r.paths
        log_probs = torch.stack([r.log_probs for r in records])
        scores = torch.stack([r.scores for r in records])
        log_z = torch.stack([r.log_z for r in records])
        margs = _pad_per_token([r.marginals for r in records], L, dtype)
        emissions = _pad_per_token([r.emissions for r in records], L, dtype)
        hidden = _pad_per_token([r.hidden for r in records], L, dtype)
        if dtype is not None:
            log_probs, scores, log_z = log_probs.to(dtype), scores.to(dtype), log_z.to(dtype)
        ids = torch.tensor([r.id for r in records], dtype=torch.long)
        kbest = KBest(scores=scores, paths=paths, log_probs=log_probs)
        return CachedBatch(ids, kbest, lengths, log_z, margs, emissions, hidden)

    def teacher_crf(self) -> tuple[Tensor, Tensor, Tensor]:
        """The teacher's (transitions (T, T), start (T,), end (T,)), float32, stored by a
        with_emissions labelling (with the teacher's constraints: -inf where forbidden)."""
        if not self.manifest.get("with_emissions"):
            raise ValueError(f"the cache in {self.directory} was labelled without with_emissions=True: "
                             "it holds no teacher CRF")
        shard = self._shard(min(self._files))
        return shard.crf["transitions"], shard.crf["start"], shard.crf["end"]

    per_sentence_crf = False   # one teacher labelled every sentence (CacheUnion: one per part)

    def teacher_crfs(self, ids) -> tuple[Tensor, Tensor, Tensor]:
        """Each sentence's teacher CRF: transitions (B, T, T), start (B, T), end (B, T)."""
        transitions, start, end = self.teacher_crf()
        B = len(ids.tolist() if isinstance(ids, Tensor) else list(ids))
        return (transitions.expand(B, *transitions.shape), start.expand(B, *start.shape),
                end.expand(B, *end.shape))

    def close(self) -> None:
        """Close every open shard (the cache reopens them on demand)."""
        self._open.clear()

    def __getstate__(self):  # DataLoader workers get a copy without the open shards
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state


class CacheUnion:
    """Teacher-label caches read as one corpus: part j's sentence i is sentence offsets[j] + i of
    the union, each part labelled by a teacher of its own (cross-fitting: fold j of the training
    text by the teacher trained without it, the DA pool by the teacher trained on all of it); a
    part may be a range of a cache's sentences. Reads like a TeacherLabelCache (len, [id], batch,
    k, label_names, manifest's with_emissions / with_hidden, teacher_info: the parts' list); when
    the parts' CRFs differ, per_sentence_crf is True, teacher_crf() refuses and teacher_crfs(ids)
    gives each sentence its own teacher's CRF (the token_pos and exact_kl losses take it per
    example).

        union = CacheUnion([load_cache("labels-fold0"), load_cache("labels-fold1"),
                            (load_cache("labels-all"), 14041, 16728)])   # its DA pool's ids only
    """

    # read like a TeacherLabelCache: the same collation, iteration and batching over self[i]
    collate = staticmethod(TeacherLabelCache.collate)
    __iter__ = TeacherLabelCache.__iter__
    batch = TeacherLabelCache.batch

    def __init__(self, parts: Sequence):
        """parts: caches, or (cache, first_id, end_id) for its sentences [first_id, end_id) only."""
        ranges = []
        for part in parts:
            cache, first, end = part if isinstance(part, tuple) else (part, 0, len(part))
            check_int("first_id", first, minimum=0, maximum=len(cache))
            check_int("end_id", end, minimum=first, maximum=len(cache))
            ranges.append((cache, first, end))
        if not ranges:
            raise ValueError("CacheUnion needs at least one cache")
        parts = [cache for cache, _, _ in ranges]
        self._firsts = [first for _, first, _ in ranges]
        for name in ("k", "num_tags", "label_names"):
            values = {repr(getattr(part, name)) for part in parts}
            if len(values) > 1:
                raise CacheMismatchError(f"the caches of a CacheUnion must share {name}; got {sorted(values)}")
        self.parts = parts
        self.offsets = np.cumsum([0] + [end - first for _, first, end in ranges]).tolist()
        flags = {key: all(part.manifest.get(key) for part in parts) for key in ("with_emissions", "with_hidden",
                                                                               "with_marginals")}
        self.manifest = dict(flags, k=parts[0].k, num_tags=parts[0].num_tags, label_names=parts[0].label_names,
                             num_sentences=self.offsets[-1], complete=all(part.complete for part in parts),
                             teacher=[part.teacher_info for part in parts], parts=[
                                 {"directory": os.path.basename(os.path.normpath(part.directory)),
                                  "first_id": offset, "part_ids": [first, end]}
                                 for (part, first, end), offset in zip(ranges, self.offsets)])
        # read once: the collator asks for them every batch
        self._crfs = [part.teacher_crf() for part in parts] if flags["with_emissions"] else []
        self.per_sentence_crf = any(not all(torch.equal(a, b) for a, b in zip(self._crfs[0], crf))
                                    for crf in self._crfs[1:])

    k = property(lambda self: self.manifest["k"], doc="paths per sentence")
    num_tags = property(lambda self: self.manifest["num_tags"], doc="the teachers' number of tags")
    label_names = property(lambda self: self.manifest["label_names"], doc="tag names, or None")
    teacher_info = property(lambda self: self.manifest["teacher"], doc="each part's teacher description")
    complete = property(lambda self: self.manifest["complete"], doc="every part's labelling finished")

    def __len__(self) -> int:
        return self.offsets[-1]

    def __repr__(self) -> str:
        return f"CacheUnion({len(self.parts)} parts, sentences={len(self)}, k={self.k})"

    def _locate(self, sentence_id) -> tuple[int, int]:
        i = _sentence_index(sentence_id, len(self))
        j = bisect.bisect_right(self.offsets, i) - 1
        return j, i - self.offsets[j]

    def __getitem__(self, sentence_id) -> CachedLabels:
        j, local = self._locate(sentence_id)
        return self.parts[j][self._firsts[j] + local]._replace(id=self.offsets[j] + local)

    def teacher_crf(self) -> tuple[Tensor, Tensor, Tensor]:
        """The one CRF every part shares; refused when the parts' teachers differ (teacher_crfs)."""
        if self.per_sentence_crf:
            raise ValueError("the parts of this CacheUnion come from teachers with different CRFs: take each "
                             "sentence's with teacher_crfs(ids)")
        return self.parts[0].teacher_crf()

    def teacher_crfs(self, ids) -> tuple[Tensor, Tensor, Tensor]:
        """Each sentence's teacher CRF: transitions (B, T, T), start (B, T), end (B, T)."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if not self._crfs:
            raise ValueError("the caches of this CacheUnion were not all labelled with with_emissions=True: they "
                             "hold no teacher CRF")
        chosen = [self._crfs[self._locate(i)[0]] for i in ids]
        return tuple(torch.stack([crf[n] for crf in chosen]) for n in range(3))  # type: ignore[return-value]


def load_cache(directory: str, **kwargs) -> TeacherLabelCache:
    """TeacherLabelCache(directory, **kwargs)."""
    return TeacherLabelCache(directory, **kwargs)
