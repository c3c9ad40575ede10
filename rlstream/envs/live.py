"""The envs of the episodes in flight in one env process: one plugin object (and workspace) per episode.

An env object holds state the Kafka records do not (files, a game), so it is kept between an episode's turns,
by episode id, up to ``max_live`` episodes (the least recently stepped is closed first). Every turn of an
episode reaches the same env worker while the group does not rebalance (records are keyed by task id), but
a worker (or a remote env server) can restart, lose the partition, or evict the env. Then the env is **rebuilt
by replay**: a fresh object and workspace, ``reset``, and every earlier action of the episode stepped again
(their results discarded: the episode already holds what the model saw), before the new action. So a plugin must be
deterministic given the task and the actions; one that cannot be replayed fails the episode as ``env_lost``.

Exactly once: the stage's outputs commit in a Kafka transaction with the input offset, but the env's own
side effects do not. A record redone after an aborted transaction, on the same worker, finds its env one step
ahead: the cached result of that step is returned instead of stepping twice.

Every call into a plugin (``reset``, ``step``, ``close``) runs with ``step_timeout_s``: one that does not return
in time fails the episode as ``env_timeout`` (its thread cannot be killed: it is abandoned with the env); one
that raises fails it as ``env_error``, or as the class of the ``EnvFailure`` it raised.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from rlstream.envs.api import Env, EnvFailure, StepResult
from rlstream.envs.workspace import Workspace
from rlstream.sandbox import Sandbox
from rlstream.schemas.records import Episode, Failure, Task

log = logging.getLogger(__name__)


@dataclass
class _Live:
    env: Env
    workspace: Workspace
    steps: int = 0  # actions this env has taken
    last: StepResult | None = None  # the result of its last step (for a redone record)
    lock: threading.Lock = field(default_factory=threading.Lock)


class LiveEnvs:
    """Per-episode env objects of one process, bounded; thread-safe."""

    def __init__(self, sandbox: Sandbox, max_live: int = 1024, step_timeout_s: float = 30.0,
                 workspace_root: str | None = None):
        self.sandbox, self.max_live, self.step_timeout_s = sandbox, max_live, step_timeout_s
        self.workspace_root = workspace_root
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self._lock = threading.Lock()
        self.rebuilt = 0  # envs rebuilt by replay (for tests and logs)

    def __len__(self) -> int:
        return len(self._live)

    def holds(self, episode_id: str) -> bool:
        """Whether the episode's env is held (not yet finished or evicted)."""
        with self._lock:
            return episode_id in self._live

    def step(self, factory: Callable[..., Env], ep: Episode) -> StepResult:
        """Step the episode's env with its last action (making or rebuilding the env as needed)."""
        actions = [t.text for t in ep.turns if t.role == "action"]
        with self._lock:
            live = self._live.get(ep.episode_id)
            if live is not None:
                self._live.move_to_end(ep.episode_id)
        if live is not None:
            with live.lock:
                if live.steps == len(actions) and live.last is not None:
                    return live.last  # this record was handled before and its outputs were not committed
                if live.steps == len(actions) - 1:
                    result = self._step(ep.episode_id, live, actions[-1])
                    if result.failure is None or result.failure.failure_class != "env_lost":
                        return result
                    # A remote server that restarted lost the episode: rebuilt below, like a restart of ours.
            self.finish(ep.episode_id)  # out of step with the episode: rebuild it from its actions
        try:
            live = self.open(factory, ep.episode_id, ep.task, actions[:-1])
        except EnvFailure as exc:
            return StepResult(done=True, failure=exc.failure())
        with live.lock:
            return self._step(ep.episode_id, live, actions[-1])

    def step_open(self, episode_id: str, action: str) -> StepResult:
        """Step an env made by ``open`` (the env server's route); EnvFailure env_lost when it is not held."""
        with self._lock:
            live = self._live.get(episode_id)
            if live is not None:
                self._live.move_to_end(episode_id)
        if live is None:
            raise EnvFailure("env_lost", f"no env for episode {episode_id!r} (never reset, closed, or evicted)")
        with live.lock:
            return self._step(episode_id, live, action)

    def open(self, factory, episode_id: str, task: Task, earlier: list[str] = ()) -> _Live:
        """Make, reset and hold an episode's env, replaying ``earlier`` actions; EnvFailure if that fails."""
        workspace = Workspace(self.sandbox, episode_id, self.workspace_root)
        try:
            env = self._call(factory, task, workspace)
            live = _Live(env, workspace)
            self._call(env.reset)
            for i, action in enumerate(earlier):
                result = self._call(env.step, action)
                live.steps += 1
                if result.done or result.failure is not None:
                    raise EnvFailure("env_lost", f"replaying the episode's actions to rebuild its env: action "
                                                 f"{i + 1} ended it; the env is not deterministic")
        except EnvFailure:
            workspace.close()
            raise
        except Exception as exc:
            workspace.close()
            raise EnvFailure("env_error", f"{type(exc).__name__}: {exc}") from exc
        if earlier:
            self.rebuilt += 1
            log.info("env of %s rebuilt by replaying %d actions", episode_id, len(earlier))
        with self._lock:
            old = self._live.pop(episode_id, None)
            self._live[episode_id] = live
            evicted = [self._live.popitem(last=False)[1] for _ in range(max(0, len(self._live) - self.max_live))]
        for gone in ([old] if old else []) + evicted:
            self._close(gone)
        return live

    def _step(self, episode_id: str, live: _Live, action: str) -> StepResult:
        try:
            result = self._call(live.env.step, action)
            if not isinstance(result, StepResult):
                raise TypeError(f"step returned {type(result).__name__}, not StepResult")
        except EnvFailure as exc:
            result = StepResult(done=True, failure=exc.failure())
        except Exception as exc:  # an env bug must not lose the episode: it ends, recorded
            log.exception("env of %s failed", episode_id)
            result = StepResult(done=True, failure=Failure("env_error", f"{type(exc).__name__}: {exc}", "env"))
        live.steps += 1
        live.last = result
        return result

    def _call(self, fn, *args):
        """``fn(*args)`` within step_timeout_s, else EnvFailure env_timeout (the call is left to finish alone)."""
        box: dict = {}

        def run():
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
        thread = threading.Thread(target=run, name="env-call", daemon=True)
        thread.start()
        thread.join(self.step_timeout_s)
        if thread.is_alive():
            raise EnvFailure("env_timeout", f"{getattr(fn, '__qualname__', fn)} did not return within "
                                            f"{self.step_timeout_s:g}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def finish(self, episode_id: str) -> None:
        """The episode ended: close its env and remove its workspace."""
        with self._lock:
            live = self._live.pop(episode_id, None)
        if live is not None:
            self._close(live)

    def _close(self, live: _Live) -> None:
        try:
            self._call(live.env.close)
        except Exception as exc:  # closing is best effort; the workspace goes regardless
            log.warning("closing an env failed: %s", exc)
        finally:
            live.workspace.close()

    def close_all(self) -> None:
        """Stage shutdown: close every env and remove every workspace."""
        with self._lock:
            lives = list(self._live.values())
            self._live.clear()
        for live in lives:
            self._close(live)
