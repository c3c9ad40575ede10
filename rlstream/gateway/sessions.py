"""Episodes of the gateway: calls grouped by session id, and a closed episode as Trajectory records.

A session is opened by whoever runs the agent (``POST /v1/sessions``: its group, group size, task name, the answer
a reward function may check, metadata), used by the agent through a header or the ``user`` field, and closed with
an optional reward (``POST /v1/sessions/{id}/close``). Each call appends to the session's current *segment*: the
call's new prompt ids (context: mask 0, log-prob 0) and the engine's sampled ids (mask 1, the engine's log-probs,
the version that sampled them). A call that does not extend the segment (``rlstream.gateway.chat``) starts a new
one; each segment becomes one Trajectory of the session's group (``<session>:<n>``), so no token of the agent's
episode is left out, and none is re-tokenized.

A closed session's id is remembered (``closed_ids``): a call for it is refused as closed, not as unknown. A
session with no call for ``timeout_s`` is closed as failed (``gateway_timeout``) and still written, with its
tokens, so the archive shows it.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from rlstream.schemas.headers import new_traceparent, now_ms, trace_id
from rlstream.schemas.records import Failure, SamplingParams, Task, Trajectory, Turn
from rlstream.engine.base import Generation

#: ``Task.env_name`` of gateway episodes (no env stage steps them: the agent is the environment).
ENV_NAME = "gateway"
#: Metadata keys the gateway writes on a trajectory's task.
SESSION_KEY, REWARD_KEY, SEGMENT_KEY = "gateway.session", "gateway.reward", "gateway.segment"
#: Most closed session ids remembered (to answer "closed" rather than "unknown").
CLOSED_REMEMBERED = 100_000


class SessionError(Exception):
    """A request about a session that cannot be served; ``status`` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Segment:
    """One run of calls whose tokens chain (see the module docstring)."""

    kind: str  # "chat" or "completion"
    prompt_text: str
    prompt_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # chat: the conversation, ending in our last answer
    text: str = ""  # completion: prompt and responses so far
    tools: str = ""  # chat: the tools the segment's calls declared (a change starts a new segment)
    ended_with_eos: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def add_context(self, text: str, ids: list[int], at: int) -> None:
        """Tokens the agent added (a tool result, a new message): context, never trained on."""
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turns.append(Turn("observation", text, start, len(self.token_ids), started_at=at, finished_at=at))

    def add_generation(self, text: str, gen: Generation, version: int, eos: int | None, started: int,
                       finished: int) -> int:
        """The engine's tokens as an action turn; its version is the oldest that sampled any of them."""
        start = len(self.token_ids)
        self.token_ids += gen.token_ids
        self.loss_mask += [1] * len(gen.token_ids)
        self.logprobs += gen.logprobs
        version = min(gen.versions, default=version)
        self.turns.append(Turn("action", text, start, len(self.token_ids), policy_version=version,
                               finish_reason=gen.finish_reason, started_at=started, finished_at=finished))
        self.ended_with_eos = bool(gen.token_ids) and gen.token_ids[-1] == eos
        return version


@dataclass
class Session:
    """One agent episode in the gateway."""

    session_id: str
    group_id: str
    group_size: int = 1
    sample_index: int = 0
    task_name: str = "gateway"
    answer: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    opened_at: int = field(default_factory=now_ms)
    last_call: float = field(default_factory=time.monotonic)
    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    traceparent: str = field(default_factory=new_traceparent)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time: each extends the last

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def trajectories(self, reward: float | None = None, failure: Failure | None = None) -> list[Trajectory]:
        """The session as Trajectory records, one per segment (none for a session without a call)."""
        out = []
        closed = now_ms()
        for n, seg in enumerate(self.segments):
            meta = {**self.metadata, SESSION_KEY: self.session_id, SEGMENT_KEY: str(n)}
            if reward is not None:
                meta[REWARD_KEY] = repr(float(reward))
            task = Task(task_id=self.session_id, group_id=self.group_id, task_name=self.task_name,
                        env_name=ENV_NAME, env_version="1", prompt=seg.prompt_text, sampling=seg.sampling,
                        created_at=self.opened_at, prompt_token_ids=seg.prompt_ids, answer=self.answer,
                        metadata=meta, group_size=self.group_size,
                        max_turns=sum(t.role == "action" for t in seg.turns), trace_id=trace_id(self.traceparent))
            versions = [t.policy_version for t in seg.turns if t.role == "action"] or [-1]
            cut = seg.turns and seg.turns[-1].finish_reason == "length"
            out.append(Trajectory(
                trajectory_id=f"{self.session_id}:{n}", group_id=self.group_id, sample_index=self.sample_index,
                task=task, response="".join(t.text for t in seg.turns), min_policy_version=min(versions),
                max_policy_version=max(versions), token_ids=seg.token_ids, loss_mask=seg.loss_mask,
                behaviour_logprobs=seg.logprobs, turns=seg.turns,
                status="failed" if failure else ("truncated" if cut else "ok"), failure=failure,
                stage_times={"gateway.open": self.opened_at, "gateway.close": closed},
                trace_id=trace_id(self.traceparent)))
        return out


class SessionBook:
    """The open sessions of one gateway process, and the ids of closed ones; thread-safe."""

    def __init__(self, timeout_s: float, auto_open: bool = False, clock=time.monotonic):
        self.timeout_s, self.auto_open, self.clock = timeout_s, auto_open, clock
        self._open: dict[str, Session] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, spec: dict) -> Session:
        """A new session from a ``POST /v1/sessions`` body; SessionError 400/409 when it cannot be opened."""
        if not isinstance(spec, dict):
            raise SessionError(400, "the body must be a JSON object")
        sid = str(spec.get("session_id") or uuid.uuid4().hex)
        try:
            session = Session(session_id=sid, group_id=str(spec.get("group_id") or sid),
                              group_size=int(spec.get("group_size", 1)), sample_index=int(spec.get("sample_index", 0)),
                              task_name=str(spec.get("task_name") or "gateway"),
                              answer=None if spec.get("answer") is None else str(spec["answer"]),
                              metadata={str(k): str(v) for k, v in (spec.get("metadata") or {}).items()},
                              last_call=self.clock())
        except (TypeError, ValueError, AttributeError) as exc:
            raise SessionError(400, f"bad session: {exc} (fields: session_id, group_id, group_size, sample_index, "
                                    "task_name, answer, metadata)") from None
        if session.group_size < 1:
            raise SessionError(400, f"group_size must be at least 1, got {session.group_size}")
        with self._lock:
            if sid in self._open or sid in self._closed:
                raise SessionError(409, f"session {sid!r} exists already; give a new session_id, or none")
            self._open[sid] = session
        return session

    def get(self, sid: str | None) -> Session:
        """The open session ``sid`` (a call is being made in it); SessionError 400/404/409 otherwise."""
        if not sid:
            raise SessionError(400, "no session: send the X-Session-Id header (or the user field) of a session "
                                    "opened with POST /v1/sessions")
        with self._lock:
            session = self._open.get(sid)
            if session is None and sid in self._closed:
                raise SessionError(409, f"session {sid!r} is closed; open a new one for a new episode")
            if session is None and self.auto_open:
                session = self._open[sid] = Session(session_id=sid, group_id=sid, last_call=self.clock())
            if session is None:
                raise SessionError(404, f"unknown session {sid!r}: open it first with POST /v1/sessions (this "
                                        "gateway may have restarted, which ends its open episodes)")
            session.last_call = self.clock()
            return session

    def close(self, sid: str) -> Session:
        """Take the open session ``sid`` out (to be written); SessionError 404/409 when it is not open."""
        with self._lock:
            session = self._open.pop(sid, None)
            if session is None:
                if sid in self._closed:
                    raise SessionError(409, f"session {sid!r} is closed already")
                raise SessionError(404, f"unknown session {sid!r}")
            self._remember(sid)
            return session

    def expired(self) -> list[Session]:
        """Take out the sessions without a call for ``timeout_s`` (closed as failed by the caller)."""
        now = self.clock()
        with self._lock:
            # A session with a call in progress holds its lock: it is not idle, whatever its last call's time.
            gone = [s for s in self._open.values() if now - s.last_call > self.timeout_s and not s.lock.locked()]
            for s in gone:
                del self._open[s.session_id]
                self._remember(s.session_id)
        return gone

    def _remember(self, sid: str) -> None:
        self._closed[sid] = None
        while len(self._closed) > CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
