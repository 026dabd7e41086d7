"""What the other prefill ranks of an attention TP (and CP) group are sending, for the leader's listing.

Every rank of the group runs its own transfer workers into its own decode
peer's pages and counts its own outstanding chunks per room (its manager's
``_staging_outstanding``; SGLang v0.5.18, disaggregation/common/conn.py and
nixl/conn.py). Only the leader serves the listing, so it must know the
others' counts before it says that no chunk of a room is in flight: decode
frees a released request's pages on every decode rank at once.

Each non-leader rank's plugin publishes its counts to a file of its own, from
a thread of its own, every ``PUBLISH_INTERVAL_S`` (a copy of the dict, no
change to SGLang, whatever its scheduler loop is doing); the leader merges
the files written in the last ``FRESH_S``. A rank whose file is missing,
stale, unsafe (not a regular file of this user, over ``MAX_FILE_BYTES``),
invalid (any count not a whole number in range), or says its manager keeps
no count is not watched, and the listing says how many ranks are
(``transfer_ranks_watched`` of ``transfer_ranks``): the watchdog's
"stopped" verdict needs every one.

The files are on the host's shared memory, in a folder of this user
(``/dev/shm/sglang-watchdog-peers-<uid>``, else under the temporary
directory; ``SGLANG_WATCHDOG_PLUGIN_PEER_DIR`` chooses another), with one
folder per server instance: its port, DP rank, PP rank and launcher. The
launcher is the process that spawned every scheduler of this server on this
host (SGLang's launcher, ``entrypoints/engine.py``, or its
DataParallelController under DP, ``managers/data_parallel_controller.py``,
v0.4.6 to v0.5.18), named by its pid and start time: two servers on one host
that share ``/dev/shm`` and a port never read each other's files. The
folders are created mode 0700 and refused (logged, the ranks unwatched) when
another user owns them or they are writable by others. Ranks of one group on
another host (multi-node TP) never appear there: the group is then never
fully watched, and decode keeps SGLang's own timeout.

The leader never reads a file on the calling thread (the scheduler thread
asks when it force-fails a Success room): one reader thread opens each file
without following links and without blocking (a FIFO is refused at its
fstat), and a caller waits for it at most ``READ_TIMEOUT_S``; while a read
is stuck (a slow file system), every other rank counts as unwatched at once.
"""

import json
import logging
import os
import queue
import stat
import tempfile
import threading
import time
from typing import NamedTuple

from .transfer_watch import MAX_LINK, RECENT, queued_by_room, queued_rooms, watched, worker_json

logger = logging.getLogger("sglang_watchdog_plugin")

PUBLISH_INTERVAL_S = 0.25
FRESH_S = 2.0
# A read of tmpfs takes milliseconds; a busy 2-core host needs a wide margin. Kept under the watchdog's listing
# timeout (--plugin.timeout, 800 ms by default), which a listing that waited for a stuck read must still meet.
READ_TIMEOUT_S = 0.5
# A rank's file holds its rooms' counts and its workers' last 32 chunks: tens of KB. Anything larger is not one.
MAX_FILE_BYTES = 1 << 20
MAX_ROOMS = 1 << 16  # rooms in one count, rooms queued on one worker
MAX_CHUNKS = 1 << 20  # outstanding or queued chunks of one room on one rank
MAX_WORKERS = 256
MAX_SECONDS = 1e9  # 31 years: a larger age is no clock's
LOG_EVERY_S = 60.0
_COPY_TRIES = 5
_INT64 = (1 << 63) - 1
_ROOM = (1 << 64) - 1
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFolder(OSError):
    """A peer folder this plugin will not use: not a directory of this user, or writable by others."""


def directory(scheduler, identity, env=os.environ, proc="/proc"):
    """The folder the ranks of this scheduler's server instance and group share on this host."""
    base = env.get("SGLANG_WATCHDOG_PLUGIN_PEER_DIR", "").strip()
    if not base:
        shm = "/dev/shm"
        base = os.path.join(shm if os.path.isdir(shm) else tempfile.gettempdir(),
                            f"sglang-watchdog-peers-{os.geteuid()}")
    port = getattr(getattr(scheduler, "server_args", None), "port", None)
    return os.path.join(base, f"port{port}-dp{identity.dp_rank}-pp{identity.pp_rank}-{launcher(proc)}")


def launcher(proc="/proc"):
    """This process's parent as "launcher<pid>.<start time>": every scheduler of one server on a host has the same
    parent, and its start time (clock ticks since boot, /proc/PID/stat field 22) tells two parents of one pid apart
    (pid reuse, or two containers' pid namespaces)."""
    ppid = os.getppid()
    try:
        with open(os.path.join(proc, str(ppid), "stat"), "rb") as f:
            started = int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        started = 0  # no /proc: every rank reads the same nothing
    return f"launcher{ppid}.{started}"


def _file(folder, attn_tp_rank, attn_cp_rank):
    return os.path.join(folder, _name(attn_tp_rank, attn_cp_rank))


def _name(attn_tp_rank, attn_cp_rank):
    return f"rank-tp{attn_tp_rank}-cp{attn_cp_rank}.json"


def _check_folder(fd, path, base):
    """Raises UnsafeFolder unless the directory open on fd is this user's (a base: or root's) and no one else may
    write it (a base: or only with the sticky bit, as /dev/shm and /tmp, where no one renames another's entry)."""
    st = os.fstat(fd)
    owners = (os.geteuid(), 0) if base else (os.geteuid(),)
    if st.st_uid not in owners:
        raise UnsafeFolder(f"peer folder {path} is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})")
    if st.st_mode & 0o022 and not (base and st.st_mode & stat.S_ISVTX):
        raise UnsafeFolder(f"peer folder {path} has mode {stat.S_IMODE(st.st_mode):04o}: writable by other users")


def open_folder(folder, create=False):
    """An fd of the instance folder after checking it and its base (creating both mode 0700 where asked), or None
    where it does not exist. Raises UnsafeFolder (or another OSError) where it may not be used."""
    base, name = os.path.split(folder)
    if create:
        os.makedirs(base, mode=0o700, exist_ok=True)
    try:
        base_fd = os.open(base, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link in place of the folder
        raise UnsafeFolder(f"peer folder {base} cannot be opened as a directory without following a link: {e}") from e
    try:
        _check_folder(base_fd, base, base=True)
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=base_fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UnsafeFolder(f"peer folder {folder} cannot be opened as a directory without following a link: "
                               f"{e}") from e
    finally:
        os.close(base_fd)
    try:
        _check_folder(fd, folder, base=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def outstanding(manager):
    """room -> outstanding chunks (> 0) of this manager, or None where it keeps no count (or it moved under us)."""
    counts = getattr(manager, "_staging_outstanding", None)
    if counts is None or not callable(getattr(counts, "items", None)):
        return None
    for _ in range(_COPY_TRIES):
        try:
            # The transfer workers change it meanwhile; a copy that raced them raises and is tried again.
            return {int(room): n for room, n in list(counts.items()) if n.__class__ is int and n > 0}
        except RuntimeError:
            continue
    return None


class Publisher:
    """A non-leader rank's side: its counts, to its file, every interval."""

    def __init__(self, folder, identity, manager, interval=PUBLISH_INTERVAL_S):
        self.folder = folder
        self.name = _name(identity.attn_tp_rank, identity.attn_cp_rank)
        self.path = os.path.join(folder, self.name)
        self.manager = manager
        self.interval = interval
        self._stop = threading.Event()
        self._thread = None
        self._oversize_logged = False

    def start(self):
        """Publishes once, then from a thread of its own. Raises UnsafeFolder where the folder may not be used."""
        os.close(open_folder(self.folder, create=True))
        self.publish()
        self._thread = threading.Thread(target=self._run, name="sglang-watchdog-peer", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception:
                # The file goes stale: the leader stops counting this rank as watched.
                logger.exception("sglang-watchdog plugin could not publish this rank's transfers to %s", self.path)

    def publish(self):
        counts = outstanding(self.manager)
        queues = getattr(self.manager, "transfer_queues", None)
        queues = queues if isinstance(queues, list) else []
        # Chunks still waiting in this rank's worker queues: not in flight (a released room's are dropped
        # unsent), but the room is not done on this rank, so the group's MIN still holds it (Group.sending).
        waiting = queued_by_room(queues)
        # What each worker holds and how fast its last chunks went, as the leader lists its own: the
        # watchdog judges a chunk of this rank by this rank's worker and link, not by the leader's. The
        # rooms waiting behind it too, which the leader's own rooms say of themselves (transfer_queue).
        monotonic = time.monotonic()
        workers = [dict(worker_json(index, queue, monotonic), queued_rooms=queued_rooms(queue))
                   for index, queue in enumerate(queues)] \
            if queues and all(hasattr(queue, "_buf") and watched(queue) for queue in queues) else None
        body = {"pid": os.getpid(), "written_unix": time.time(), "tracking": counts is not None,
                "in_flight": {str(room): n for room, n in (counts or {}).items()},
                "queued": {str(room): n for room, n in waiting.items() if isinstance(room, int) and n > 0},
                "transfer_workers": workers}
        data = json.dumps(body, allow_nan=False).encode()
        if len(data) > MAX_FILE_BYTES and workers is not None:
            # The counts matter more than the workers: a file the leader refuses makes the rank unwatched.
            body["transfer_workers"] = None
            data = json.dumps(body, allow_nan=False).encode()
        if len(data) > MAX_FILE_BYTES:
            if not self._oversize_logged:
                logger.warning("sglang-watchdog plugin: this rank's transfers take %d bytes, over the peer file's "
                               "%d; not published, the leader counts this rank as unwatched", len(data),
                               MAX_FILE_BYTES)
                self._oversize_logged = True
            return
        self._write(data)

    def _write(self, data):
        folder = open_folder(self.folder)
        if folder is None:
            raise FileNotFoundError(f"peer folder {self.folder} is gone")
        tmp = f"{self.name}.{os.getpid()}.tmp"
        try:
            try:
                fd = _create(tmp, folder)
            except FileExistsError:  # left by a crash, or planted: the name is removed, never written through
                os.unlink(tmp, dir_fd=folder)
                fd = _create(tmp, folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # Readers see the old file or the new one, never half of one; a link planted at the name is replaced.
            os.replace(tmp, self.name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            os.close(folder)


def _create(name, folder):
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)


class Peer(NamedTuple):
    """One other rank as its fresh, valid file tells it."""

    in_flight: dict  # room -> outstanding chunks
    queued: dict  # room -> chunks waiting in its worker queues
    workers: list | None  # its transfer_workers, each checked, or None (not reported, or not valid)


class View(NamedTuple):
    """The other ranks of the group as their fresh files tell them."""

    watched: int  # ranks whose fresh file says their manager counts
    in_flight: dict  # room -> outstanding chunks, summed over them
    queued: dict  # room -> chunks waiting in their worker queues, summed over them
    workers: list  # {"rank": "tp<R>-cp<C>", "transfer_workers": [...]} of each that reports its workers


class Group:
    """The leader's side: the other ranks' files, merged."""

    def __init__(self, folder, identity):
        self.folder = folder
        self.size = max(1, identity.attn_tp_size) * max(1, identity.attn_cp_size)
        self.others = [(tp, cp) for tp in range(max(1, identity.attn_tp_size))
                       for cp in range(max(1, identity.attn_cp_size))
                       if (tp, cp) != (identity.attn_tp_rank, identity.attn_cp_rank)]
        self._logged = {}  # what -> when it was last logged (monotonic)

    def read(self, now_unix=None, queues=None):
        """What the other ranks' fresh files say, merged (a View). queues: the leader's transfer queue count,
        which a rank's listed workers may not exceed."""
        view = View(0, {}, {}, [])
        for (tp, cp), peer in self._watched(now_unix).items():
            view = view._replace(watched=view.watched + 1)
            for room, n in peer.in_flight.items():
                view.in_flight[room] = view.in_flight.get(room, 0) + n
            for room, n in peer.queued.items():
                view.queued[room] = view.queued.get(room, 0) + n
            if peer.workers is not None and (queues is None or len(peer.workers) <= queues):
                view.workers.append({"rank": f"tp{tp}-cp{cp}", "transfer_workers": peer.workers})
        return view

    def sending(self, room, now_unix=None):
        """(whether another rank still has a chunk of the room outstanding or waiting in its worker queues,
        the other ranks not watched now as "tp<R>-cp<C>"): a room quiet on the watched ranks is done on the group
        only if that list is empty."""
        peers = self._watched(now_unix)
        if any(peer.in_flight.get(room, 0) > 0 or peer.queued.get(room, 0) > 0 for peer in peers.values()):
            return True, []
        return False, [f"tp{tp}-cp{cp}" for tp, cp in self.others if (tp, cp) not in peers]

    def _watched(self, now_unix):
        """(tp, cp) -> Peer of every other rank whose file is fresh, valid and says its manager counts; read by the
        reader thread, {} where it did not answer within READ_TIMEOUT_S."""
        peers = _READER.call(lambda: self._load(now_unix))
        if peers is None:
            self._log("timeout", "sglang-watchdog plugin: reading the peer files under %s took over %.1f s (a slow "
                      "file system?); the other ranks of the group count as unwatched", self.folder, READ_TIMEOUT_S)
            return {}
        return peers

    def _load(self, now_unix):
        try:
            folder = open_folder(self.folder)
        except OSError as e:
            self._log("folder", "sglang-watchdog plugin refuses the peer folder: %s; the other ranks of the group "
                      "count as unwatched", e)
            return {}
        if folder is None:
            return {}
        try:
            peers = {}
            for tp, cp in self.others:
                peer, problem = _peer(folder, _name(tp, cp), now_unix)
                if peer is not None:
                    peers[(tp, cp)] = peer
                elif problem:
                    self._log(f"tp{tp}-cp{cp}", "sglang-watchdog plugin refuses the peer file of tp%d-cp%d under %s: "
                              "%s; that rank counts as unwatched", tp, cp, self.folder, problem)
            return peers
        finally:
            os.close(folder)

    def _log(self, what, message, *args):
        now = time.monotonic()
        if now - self._logged.get(what, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[what] = now
            logger.warning(message, *args)


class _Reader:
    """One thread that reads the peer files for any caller, who waits for it at most READ_TIMEOUT_S: a read that
    blocks costs its caller (the scheduler thread too) that long once, then nothing while it stays blocked."""

    def __init__(self):
        self._jobs = None
        self._lock = threading.Lock()
        self._pid = None  # the process the thread runs in: a forked child starts its own
        self._busy_since = None  # time.monotonic() at the start of the job under way

    def call(self, fn):
        """fn()'s result, or None where the reader did not return it in time (or is still stuck in another)."""
        with self._lock:
            if self._busy_since is not None and time.monotonic() - self._busy_since > READ_TIMEOUT_S:
                return None
            if self._pid != os.getpid():
                self._jobs, self._busy_since, self._pid = queue.SimpleQueue(), None, os.getpid()
                threading.Thread(target=self._run, args=(self._jobs,), name="sglang-watchdog-peer-reader",
                                 daemon=True).start()
            jobs = self._jobs
        done, result = threading.Event(), []
        jobs.put((fn, done, result))
        done.wait(READ_TIMEOUT_S)
        return result[0] if result else None

    def _run(self, jobs):
        while True:
            fn, done, result = jobs.get()
            with self._lock:
                self._busy_since = time.monotonic()
            try:
                result.append(fn())
            except Exception:
                logger.exception("sglang-watchdog plugin could not read the peer files")
            finally:
                with self._lock:
                    self._busy_since = None
                done.set()


_READER = _Reader()


def _peer(folder, name, now_unix):
    """(the Peer a fresh valid file makes, None) or (None, why it is refused; "" where missing, stale or untracked,
    which is no one's fault)."""
    data, problem = _read(folder, name)
    if data is None:
        return None, problem
    try:
        body = json.loads(data.decode("utf-8"))
    except ValueError as e:  # also UnicodeDecodeError
        return None, f"not JSON ({e})"
    except RecursionError:
        return None, "JSON nested too deep"
    if body.__class__ is not dict:
        return None, "not a JSON object"
    if body.get("tracking") is not True:
        return None, ""
    # The age is taken after the read: a file the rank replaced between a clock read and this one would otherwise
    # come from the future and pass for stale.
    now = time.time() if now_unix is None else now_unix
    written = body.get("written_unix")
    if not _number(written, MAX_SECONDS * 10):
        return None, f"written_unix {_show(written)} is not a time"
    if not 0 <= now - written <= FRESH_S:
        return None, ""
    in_flight, queued = _rooms(body.get("in_flight")), _rooms(body.get("queued", {}))
    if in_flight is None or queued is None:
        return None, "in_flight or queued is not {room: chunks} of whole numbers in range"
    return Peer(in_flight, queued, _workers(body.get("transfer_workers"))), ""


def _read(folder, name):
    """(the file's bytes, "") or (None, why not): a regular file of this user of at most MAX_FILE_BYTES, opened
    without following a link or waiting for a FIFO's writer."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"cannot be opened without following a link ({e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_uid != os.geteuid():
            return None, f"owned by uid {st.st_uid}, not this user"
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:  # the size may grow after the fstat: the read is what is capped
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                return b"".join(chunks), ""
            chunks.append(chunk)
            size += len(chunk)
        return None, f"over {MAX_FILE_BYTES} bytes"
    except OSError as e:
        return None, f"unreadable ({e})"
    finally:
        os.close(fd)


def _int(value, low=0, high=_INT64):
    return value.__class__ is int and low <= value <= high


def _number(value, high=MAX_SECONDS):
    # NaN and the infinities fail the comparison; a huge int fails it before it meets a float.
    return value.__class__ in (int, float) and 0 <= value <= high


def _link(value):
    if value.__class__ is not str:
        return False
    try:
        return len(value.encode("utf-8")) <= MAX_LINK
    except UnicodeEncodeError:  # a lone surrogate, from a "\ud800" escape
        return False


def _show(value):
    return repr(value)[:40]


def _room(key):
    """A room id from a JSON key, as str(room) writes it (0 to 2**64 - 1, as the watchdog reads it), or None."""
    if not (key.isascii() and key.isdigit() and len(key) <= 20 and key == str(int(key))):
        return None
    room = int(key)
    return room if room <= _ROOM else None


def _rooms(value):
    """room -> count (> 0) of a file's in_flight or queued, or None if any entry is not one (the rank is then
    unwatched: an unreadable count must not pass for a quiet one)."""
    if value.__class__ is not dict or len(value) > MAX_ROOMS:
        return None
    rooms = {}
    for key, n in value.items():
        room = _room(key)
        if room is None or not _int(n, 0, MAX_CHUNKS):
            return None
        if n:
            rooms[room] = n
    return rooms


def _workers(value):
    """A rank's transfer_workers as the leader may list them (a new copy of the fields worker_json writes, each
    checked as the watchdog checks them), or None if it reports none or any is not valid: a bad worker costs that
    rank's workers, never the leader's listing."""
    if value.__class__ is not list or len(value) > MAX_WORKERS:
        return None
    workers = []
    for index, worker in enumerate(value):
        worker = _worker(worker, index)
        if worker is None:
            return None
        workers.append(worker)
    return workers


def _worker(w, index):
    if w.__class__ is not dict:
        return None
    queue, tracked, depth, taken = w.get("transfer_queue"), w.get("tracked"), w.get("depth"), w.get("chunks_taken")
    if not (_int(queue) and queue == index and tracked.__class__ is bool and _int(depth) and _int(taken)):
        return None
    out = {"transfer_queue": index, "tracked": tracked, "depth": depth, "chunks_taken": taken, "in_flight": None}
    chunk = w.get("in_flight")
    if chunk is not None:
        if chunk.__class__ is not dict:
            return None
        number, room, pages = chunk.get("chunk"), chunk.get("bootstrap_room"), chunk.get("pages")
        last, seconds, link = chunk.get("last_chunk"), chunk.get("seconds"), chunk.get("link", "")
        if not (_int(number) and _int(room, 0, _ROOM) and _int(pages) and last.__class__ is bool and _number(seconds)
                and _link(link)):
            return None
        out["in_flight"] = {"chunk": number, "bootstrap_room": room, "pages": pages, "last_chunk": last,
                            "seconds": seconds, "link": link}
    recent = w.get("recent")
    if recent.__class__ is not list or len(recent) > RECENT or not all(
            pair.__class__ is list and len(pair) == 2 and _int(pair[0]) and _number(pair[1]) for pair in recent):
        return None
    out["recent"] = [list(pair) for pair in recent]
    finished = w.get("finished")
    if finished is not None:
        if finished.__class__ is not list or len(finished) > RECENT:
            return None
        out["finished"] = []
        for entry in finished:
            if entry.__class__ is not dict:
                return None
            number, pages = entry.get("chunk"), entry.get("pages")
            seconds, link = entry.get("seconds"), entry.get("link")
            # Increasing chunk numbers, as the watchdog requires of every worker of a listing.
            if not (_int(number) and _int(pages) and _number(seconds) and _link(link)) or (
                    out["finished"] and number <= out["finished"][-1]["chunk"]):
                return None
            out["finished"].append({"chunk": number, "pages": pages, "seconds": seconds, "link": link})
    rooms = w.get("queued_rooms")
    if rooms is not None:
        if rooms.__class__ is not list or len(rooms) > MAX_ROOMS:
            return None
        if not all(_int(room, 0, _ROOM) for room in rooms):
            return None
        out["queued_rooms"] = list(rooms)
    return out
