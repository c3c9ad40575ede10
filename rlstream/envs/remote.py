"""Remote environments over HTTP: the env stage's client (``--env-url``) and the protocol both sides speak.

An env server runs the plugin interface (``rlstream.envs.api``) behind three JSON POST routes, so an
environment can live in its own container or host and be written in any language:

- ``POST /reset`` ``{"episode_id": str, "task": Task as a dict}`` -> ``{}``: make the episode's env (a new one
  replaces any of that id) and reset it;
- ``POST /step`` ``{"episode_id": str, "action": str}`` -> a StepResult as a dict (``step_result_to_dict``);
- ``POST /close`` ``{"episode_id": str}`` -> ``{}``: the episode ended; drop its env (unknown ids are fine);
- ``GET /health`` -> ``{"ok": true}``.

An error is a non-2xx status with ``{"error": str, "failure_class": str}``: 404 with ``env_lost`` for a step of
an episode the server does not hold (it restarted), 4xx for a request it cannot read, 5xx ``env_error`` when
the env raised. Failure classes on the client: a call that reaches no server (connection refused, DNS, reset
before an answer) is tried again ``retries`` times with backoff, then ``env_unreachable``; no answer within
``timeout_s`` is ``env_timeout`` (never retried: the step may have happened); an error answer is its class.

A server that stays down fails the episode as ``env_unreachable``, which is no verdict on the model: the env stage
then sends the task back to ``prompts`` as a new task (``TaskRetries``), up to a limit.

Every POST carries ``Idempotency-Key`` (the IETF httpapi draft's header, its value a quoted string): the same key
for every sending of the same call of the same episode, so that a server can recognise a repeat
(``idempotency_key`` defines it; docs/concepts/side-effects.md says when repeats happen). ``Rlstream-Attempt`` says which
sending of this process it is (1, then 2... for the retries above); it is no part of the key.
"""
from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict

from rlstream.envs.api import Env, EnvFailure, StepResult
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Failure, Task, ToolCall, ToolResult

log = logging.getLogger(__name__)

#: Failure classes after which a task is run again (the env, not the model, failed it).
RETRIED_CLASSES = ("env_unreachable",)
#: Task metadata of a retried task: the task and group it retries, and its attempt (1 for the first retry).
RETRY_OF, RETRY_GROUP, ATTEMPT = "env.retry_of", "env.retry_group", "env.attempt"
#: Retried task ids remembered per process, so that the G failed episodes of one task retry it once.
REMEMBERED = 100_000
#: The request headers of the key and of this process's sending of the call.
KEY_HEADER, ATTEMPT_HEADER = "Idempotency-Key", "Rlstream-Attempt"


def idempotency_key(task: Task, episode_id: str, call: str) -> str:
    """The key of one call of one episode: ``call`` is ``reset``, ``step/<n>`` (the episode's n-th action, from 1)
    or ``close``.

    What is in it is what a redo of the same input record repeats: the task as its source produced it (its trace id
    and creation time, random and fixed in the record, so two runs over one dataset never share a key), the episode
    and the call. What is not: which worker sends it, how often (a SIGKILL, an aborted transaction or a connection
    retry sends the same key again), and when. A task the env stage retries is a new task (``<task>.retryN``), so
    its calls have keys of their own.
    """
    identity = "\x1f".join(("rlstream-env/1", task.trace_id, str(task.created_at), episode_id, call))
    return hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def step_result_to_dict(result: StepResult) -> dict:
    return {"done": result.done, "observation": result.observation, "truncated": result.truncated,
            **{k: None if getattr(result, k) is None else getattr(result, k).to_dict()
               for k in ("tool_call", "tool_result", "failure")}}


def step_result_from_dict(data: dict) -> StepResult:
    """A StepResult from its dict; ValueError when it is not one."""
    try:
        return StepResult(done=bool(data["done"]), observation=data.get("observation"),
                          truncated=bool(data.get("truncated", False)),
                          tool_call=ToolCall.from_dict(data["tool_call"]) if data.get("tool_call") else None,
                          tool_result=ToolResult.from_dict(data["tool_result"]) if data.get("tool_result") else None,
                          failure=Failure.from_dict(data["failure"]) if data.get("failure") else None)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a step result: {exc!r}") from None


class RemoteEnvs:
    """The env factory of one env server: ``RemoteEnvs(url)(task, workspace)`` is that episode's RemoteEnv."""

    version = "remote"

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--env-url {url!r}: expected http://host:port")
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s

    def __call__(self, task: Task, workspace) -> "RemoteEnv":
        return RemoteEnv(self, task, workspace.episode_id)

    def post(self, route: str, body: dict, key: str, retries: int | None = None) -> dict:
        """POST ``body`` to ``route`` under idempotency ``key``; the JSON answer, or EnvFailure with the call's
        class."""
        data = json.dumps(body).encode()
        wait, retries = self.backoff_s, self.retries if retries is None else retries
        for attempt in range(retries + 1):
            request = urllib.request.Request(self.url + route, data=data, method="POST",
                                             headers={"Content-Type": "application/json", KEY_HEADER: f'"{key}"',
                                                      ATTEMPT_HEADER: str(attempt + 1)})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as exc:
                raise _answered(route, exc) from None
            except (TimeoutError, socket.timeout) as exc:
                raise EnvFailure("env_timeout", f"{self.url}{route}: no answer within {self.timeout_s:g}s") from exc
            except (urllib.error.URLError, ConnectionError) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    raise EnvFailure("env_timeout", f"{self.url}{route}: no answer within {self.timeout_s:g}s") \
                        from exc
                if attempt == retries:
                    raise EnvFailure("env_unreachable", f"{self.url}{route}: {reason} (tried {attempt + 1} "
                                                        "times)") from exc
            except ValueError as exc:
                raise EnvFailure("env_error", f"{self.url}{route}: the answer is not JSON: {exc}") from exc
            time.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")


def _answered(route: str, exc: urllib.error.HTTPError) -> EnvFailure:
    """The failure an error answer carries (its own class, else env_error)."""
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        body = {}
    return EnvFailure(body.get("failure_class") or "env_error",
                      f"{route}: HTTP {exc.code}: {body.get('error') or exc.reason}")


class RemoteEnv(Env):
    """One episode's env on a server."""

    def __init__(self, server: RemoteEnvs, task: Task, episode_id: str):
        self.server, self.task, self.episode_id = server, task, episode_id
        # LiveEnvs resets an env once and steps it with the episode's actions in order (replaying the earlier ones
        # when it rebuilds it), so counting the steps here numbers them as the episode does.
        self.steps = 0

    def key(self, call: str) -> str:
        return idempotency_key(self.task, self.episode_id, call)

    def reset(self) -> None:
        self.steps = 0
        self.server.post("/reset", {"episode_id": self.episode_id, "task": self.task.to_dict()}, self.key("reset"))

    def step(self, action: str) -> StepResult:
        self.steps += 1
        answer = self.server.post("/step", {"episode_id": self.episode_id, "action": action},
                                  self.key(f"step/{self.steps}"))
        try:
            return step_result_from_dict(answer)
        except ValueError as exc:
            raise EnvFailure("env_error", f"/step: {exc}") from None

    def close(self) -> None:
        # Not retried: a server that is gone holds nothing to close.
        self.server.post("/close", {"episode_id": self.episode_id}, self.key("close"), retries=0)


class TaskRetries:
    """Which failed tasks run again: a new task ``<task>.retry<N>`` in a group of its own (``<group>.retry<N>``),
    for at most ``limit`` attempts after the first. Every episode of a task reaches the same env worker (they share
    its key), so remembering the retried ids here makes one retry per task, not one per failed episode; after a
    rebalance a task can be retried twice, which costs a group, never a sample."""

    def __init__(self, limit: int):
        self.limit = limit
        self._done: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def retry(self, task: Task, failure: Failure | None) -> list[Task]:
        """The task to send back to ``prompts`` after an episode of ``task`` failed with ``failure`` (or none)."""
        if failure is None or failure.failure_class not in RETRIED_CLASSES:
            return []
        attempt = int(task.metadata.get(ATTEMPT, "0")) + 1
        original, group = task.metadata.get(RETRY_OF, task.task_id), task.metadata.get(RETRY_GROUP, task.group_id)
        if attempt > self.limit:
            log.warning("task %s failed as %s on attempt %d; not retried (--env-task-retries %d)", original,
                        failure.failure_class, attempt, self.limit)
            return []
        again = Task.from_dict(task.to_dict())
        again.task_id = f"{original}.retry{attempt}"
        again.group_id = f"{group}.retry{attempt}"
        again.metadata.update({RETRY_OF: original, RETRY_GROUP: group, ATTEMPT: str(attempt)})
        again.created_at = now_ms()
        with self._lock:
            if again.task_id in self._done:
                return []
            self._done[again.task_id] = None
            while len(self._done) > REMEMBERED:
                self._done.popitem(last=False)
        log.warning("task %s failed as %s; sent back to prompts as %s", original, failure.failure_class,
                    again.task_id)
        return [again]
