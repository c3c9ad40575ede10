"""Calling a stage's handlers: a batch handler as one call in the thread pool, per-record handlers in the pool
(sync, ``SyncHandler``) or on the runner's event loop (async), each with its timeout, every failure turned into the
dead-letter reason of the record that caused it (never into a crash of the stage).
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from rlstream import metrics
from rlstream.kafka.records import Incoming, Rejected
from rlstream.runtime.settings import RuntimeSettings
from rlstream.runtime.stage import InvalidRecord, Output, Stage, SyncHandler

Result = "list[Output] | Rejected"


class Handlers:
    """Runs one stage's ``handle``/``handle_batch`` with timeouts; owns the pool and the event loop they use."""

    def __init__(self, stage: Stage, settings: RuntimeSettings, loop: asyncio.AbstractEventLoop | None = None,
                 pool: ThreadPoolExecutor | None = None):
        """``loop`` and ``pool``: another stage's, shared (a chain, ``runtime.chain``); that stage closes them."""
        self.stage = stage
        self.settings = settings
        self._owns = pool is None and loop is None  # a chain's second stage borrows the first's pool and loop
        self.pool = pool or ThreadPoolExecutor(max_workers=max(1, settings.concurrency),
                                               thread_name_prefix=f"{stage.name}-handler")
        if loop is None:
            loop = asyncio.new_event_loop()
            # asyncio.to_thread (sync reward functions) uses the default executor: make it ours, sized by concurrency.
            loop.set_default_executor(self.pool)
        self.loop = loop
        # Pipelined records not started yet, and tasks started and not finished (both touched on the loop only):
        # at most ``concurrency`` handlers run at once, enforced in _start_waiting.
        self._waiting: deque = deque()
        self._tasks = 0
        self._limit = max(1, settings.concurrency)
        # A stage may need longer than the generic knob (rollout on a fleet: a request's own timeout and retries).
        self.timeout_s = max(settings.handler_timeout_s, stage.handler_timeout_s or 0.0)
        self._async = asyncio.iscoroutinefunction(stage.handle)
        self.sync = stage.sync_handler()
        self._deadlines = Deadlines() if self.sync is not None else None
        # Sync records waiting for a drainer, and how many drainers run (``submit_sync``): the count changes only
        # under the lock, so a record is never queued with no drainer left to take it.
        self._pending: deque = deque()
        self._drainers = 0
        self._drain_lock = threading.Lock()
        self._seconds = metrics.HANDLER_SECONDS.labels(stage.name)  # a labels() lookup per record costs as much

    @property
    def batched(self) -> bool:
        """Whether the stage handles whole batches (then it is never pipelined): the stage's own word."""
        return self.stage.batched

    def close(self) -> None:
        if self._deadlines is not None:
            self._deadlines.close()
        if not self._owns:
            return
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.loop.close()

    # -- one batch, on the caller's thread ------------------------------------------------------------------------

    def handle_all(self, items: list[Incoming]) -> list[Result]:
        """Every record's outputs or rejection, in order."""
        if not items:
            return []
        batch = self._run_timed(self._call_batch, items, len(items))
        if isinstance(batch, list):
            return batch
        if batch is not None:
            # The batch failed as a whole: handle records one by one to isolate the bad one.
            return [_first(self._run_timed(self._call_batch, [it], 1)) for it in items]
        return self.loop.run_until_complete(self._handle_each(items))

    def _call_batch(self, items: list[Incoming]):
        result = self.stage.handle_batch(items)
        if result is None:
            return None
        if len(result) != len(items):
            raise TypeError(f"handle_batch returned {len(result)} results for {len(items)} records")
        # A batch handler refuses one record by putting its exception in that record's place (Stage.handle_batch).
        return [self.rejection(r) if isinstance(r, Exception) else r for r in result]

    def _run_timed(self, fn, items: list[Incoming], n: int):
        """Run a batch handler in the pool with a timeout scaled to the batch; errors become Rejected.

        One pool call for the whole batch, no event loop: the loop is for handlers whose records run at once."""
        future = self.pool.submit(fn, items)
        try:
            return future.result(self.timeout_s * max(1, math.ceil(n / 8)))
        except FutureTimeout:
            future.cancel()  # a started handler cannot be stopped: it finishes in the background, its result dropped
            return Rejected("handler_timeout", f"handler exceeded {self.timeout_s}s")
        except Exception as exc:
            return self.rejection(exc)

    async def _handle_each(self, items: list[Incoming]) -> list[Result]:
        sem = asyncio.Semaphore(max(1, self.settings.concurrency))

        async def one(item: Incoming):
            async with sem:
                return await self.handle_one(item)

        return list(await asyncio.gather(*(one(it) for it in items)))

    # -- pipelined: records submitted to the loop running in its own thread ---------------------------------------

    def submit(self, items: list[Incoming], run=None) -> list[Future]:
        """Start these records' handlers on the running loop; each future resolves to outputs or a rejection, and
        cancelling it cancels its handler. ``run``: the coroutine function a record goes through instead of
        ``handle_one`` (a chain's: both stages).

        One wake-up of the loop for all of them: a wake-up per record (``run_coroutine_threadsafe``) cost a
        self-pipe write and a loop turn each, 6-7 ms of env's and reward's CPU per 128-record version.

        A sync handler (``Stage.sync_handler``) skips the loop: each record is one call in the pool, resolving its
        future on the pool's thread (a task, an executor future and a loop wake-up fewer per record: about 40% of
        a reward hop's CPU on 20-token records, measured in one process against the idle broker)."""
        if run is None and self.sync is not None:
            return [self.submit_sync(item) for item in items]
        futures = [Future() for _ in items]
        if not futures:
            return futures
        run = run or self.handle_one

        def start() -> None:
            self._waiting.extend((run, item, future) for item, future in zip(items, futures))
            self._start_waiting()
        self.loop.call_soon_threadsafe(start)
        return futures

    def _start_waiting(self) -> None:
        """On the loop: a task for each waiting record while fewer than ``concurrency`` run; a task's end starts
        the next. A record waiting for a free slot is a tuple here rather than a task blocked on a semaphore (a
        future and a wake-up more per record of a full poll), and its handler timeout has not started."""
        while self._waiting and self._tasks < self._limit:
            run, item, future = self._waiting.popleft()
            if future.cancelled():
                continue
            task = self.loop.create_task(run(item))
            self._tasks += 1
            task.add_done_callback(lambda t, f=future: self._task_done(f, t))
            future.add_done_callback(lambda f, t=task: f.cancelled() and self.loop.call_soon_threadsafe(t.cancel))

    def _task_done(self, future: Future, task: asyncio.Task) -> None:
        self._tasks -= 1
        _settle(future, task)
        self._start_waiting()

    def submit_sync(self, item: Incoming, future: Future | None = None) -> Future:
        """One record through the stage's sync handler on the pool; its future (``future``, else a new one)
        resolves on the pool's thread (or the deadline watcher's, at its timeout).

        The record joins a queue that up to ``concurrency`` pool tasks drain, each taking the next record as it
        finishes one: a pool task per record (a work item, the pool's queue and a thread woken for each) was a
        third of a pipelined reward hop's CPU with an exact-match judge. A slow record holds up only its own
        drainer; the others go on taking records, as the pool's threads took tasks."""
        future = Future() if future is None else future
        with self._drain_lock:
            self._pending.append((item, future))
            start = self._drainers < self._limit
            self._drainers += start
        if start:
            self.pool.submit(self._drain)
        return future

    def _drain(self) -> None:
        """On a pool thread: records from the queue until it is empty (``submit_sync``)."""
        pending, sync = self._pending, self.sync
        while True:
            try:
                item, future = pending.popleft()
            except IndexError:
                with self._drain_lock:
                    if pending:
                        continue  # appended between the pop and the lock: a submitter counted this drainer
                    self._drainers -= 1
                    return
            self._call_sync(sync, item, future)

    def call_sync_here(self, item: Incoming, future: Future) -> None:
        """``submit_sync`` on the calling thread, which must be one of the pool's: the handler runs now, its timeout
        watched as on the pool (at the deadline ``future`` resolves with the timeout outcome, and its callbacks run,
        whatever this thread is still doing: attach them first). A chain's second stage runs so on the thread that
        finished the first."""
        self._call_sync(self.sync, item, future)

    def on_deadline_watcher(self) -> bool:
        """Whether the calling thread is this stage's timeout watcher, which must never run a handler."""
        return self._deadlines is not None and self._deadlines.watching()

    def _call_sync(self, sync: SyncHandler, item: Incoming, future: Future) -> None:
        """On a pool thread: the record's handler, its timeout watched from when it starts (as on the loop, a record
        waiting for a free thread has not started its timeout)."""
        if not future.set_running_or_notify_cancel():
            return  # cancelled while it waited (a rewind, a revoked partition)
        started = time.monotonic()
        timeout = min(self.timeout_s, sync.timeout_s or math.inf)
        self._deadlines.add(started + timeout, future, lambda: self._given_up(sync, item, timeout))
        try:
            result = sync.fn(item)
            if not isinstance(result, list) or not all(isinstance(o, Output) for o in result):
                raise TypeError(f"handler returned {type(result).__name__}, expected list[Output]")
        except Exception as exc:
            result = self.rejection(exc)
        finally:
            self._seconds.observe(time.monotonic() - started)
        resolve(future, result)

    def _given_up(self, sync: SyncHandler, item: Incoming, timeout: float) -> Result:
        """A sync handler still running at its timeout: the stage's outcome for that, or a handler_timeout."""
        if sync.timed_out is not None and sync.timeout_s is not None and sync.timeout_s <= self.timeout_s:
            try:
                return sync.timed_out(item)
            except Exception as exc:
                return self.rejection(exc)
        return Rejected("handler_timeout", f"handler exceeded {timeout}s")

    async def handle_one(self, item: Incoming) -> Result:
        """One record through the stage's handler (async, or sync in the pool), with its timeout."""
        handler = self.stage.handle
        started = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: wait_for runs the handler in a task of its own (a task, a future and a
            # loop turn more per record).
            async with asyncio.timeout(self.timeout_s):
                if self._async:
                    result = await handler(item)
                else:
                    result = await self.loop.run_in_executor(self.pool, handler, item)
            if not isinstance(result, list) or not all(isinstance(o, Output) for o in result):
                raise TypeError(f"handler returned {type(result).__name__}, expected list[Output]")
            return result
        except Exception as exc:
            return self.rejection(exc)
        finally:
            self._seconds.observe(time.monotonic() - started)

    def rejection(self, exc: Exception) -> Rejected:
        """The dead-letter reason for a handler's failure."""
        if isinstance(exc, asyncio.TimeoutError):
            return Rejected("handler_timeout", f"handler exceeded {self.timeout_s}s")
        if isinstance(exc, InvalidRecord):
            return Rejected("invalid", str(exc))
        return Rejected("handler_error", f"{type(exc).__name__}: {exc}")


class Deadlines:
    """Sync handlers' timeouts, watched by one thread for the whole pool (a timer per record would be a thread per
    record). A record past its deadline whose future is not done yet is resolved with the outcome its entry names;
    the handler's own result, if it ever comes, is then dropped (``resolve``).

    Entries arrive in deadline order but for the few microseconds between handlers' starts (one timeout per stage,
    taken as each handler starts), so the watcher only ever looks at the oldest. Every pool thread adds one entry
    per record, without a lock: a deque's append and popleft are atomic, and only the watcher pops (a lock taken per
    add, by up to ``concurrency`` threads at once, was a fifth of a pipelined hop's CPU). The watcher drops finished
    entries from the front, waking at the oldest deadline or every ``PRUNE_S``, whichever comes first, so the queue
    holds about the records of the last ``PRUNE_S`` and those still running."""

    PRUNE_S = 0.05

    def __init__(self) -> None:
        self._entries: deque = deque()
        self._wake = threading.Event()
        self._idle = False  # the watcher sleeps with no entries: the next add must wake it
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first add (a batched stage never needs it)
        self._starting = threading.Lock()

    def add(self, deadline: float, future: Future, outcome) -> None:
        self._entries.append((deadline, future, outcome))
        if self._thread is None:
            with self._starting:
                if self._thread is None:
                    thread = threading.Thread(target=self._watch, name="handler-deadlines", daemon=True)
                    thread.start()
                    self._thread = thread
        if self._idle:  # read after the append: see _watch for why no wake-up is lost
            self._wake.set()

    def watching(self) -> bool:
        return self._thread is threading.current_thread()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _watch(self) -> None:
        entries = self._entries
        while not self._closed:
            if not entries:
                # Idle is announced before the queue is looked at again: an add that appended before this look is
                # seen by it, and one that appends after it reads idle and sets the event.
                self._idle = True
                if not entries and not self._closed:
                    self._wake.wait()
                self._idle = False
                self._wake.clear()
                continue
            deadline, future, outcome = entries[0]
            if future.done():
                entries.popleft()
                continue
            wait = deadline - time.monotonic()
            if wait > 0:
                if self._wake.wait(min(wait, self.PRUNE_S)):
                    self._wake.clear()  # a late wake-up meant for an idle watcher, or close
                continue
            entries.popleft()
            resolve(future, outcome())


def resolve(future: Future, result) -> None:
    """Set a sync record's result unless it was given up on (or cancelled) meanwhile: the first outcome stands."""
    try:
        future.set_result(result)
    except InvalidStateError:
        pass


def _settle(future: Future, task: asyncio.Task) -> None:
    """Hand a finished handler task's outcome to the caller's future (unless the caller cancelled it meanwhile)."""
    try:
        if task.cancelled():
            future.cancel()
        elif task.exception() is not None:
            future.set_exception(task.exception())
        else:
            future.set_result(task.result())
    except InvalidStateError:  # cancelled by the caller in the meantime
        pass


def _first(result):
    """The outputs of a one-record batch, or its rejection."""
    return result if isinstance(result, Rejected) else result[0]
