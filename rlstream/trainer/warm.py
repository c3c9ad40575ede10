"""A trainer's warm standby (``--standby``): what it loads before it waits, and the wait.

It resumes nothing while it waits: the primary publishes a version every step, so what a takeover resumes is read
once the primary is gone (``TrainerService._load_or_create``). What it can do ahead is everything that does not
depend on the version: its imports, its device, and its model's class.
"""
from __future__ import annotations

from rlstream.config import KafkaSettings
from rlstream.kafka.standby import Line, await_vacancy
from rlstream.models.loading import is_local, warm_imports
from rlstream.runtime.settings import RuntimeSettings


def model_spec(service) -> str:
    """A folder whose config names the model a takeover resumes: the newest stored version in a local store, else
    ``--model`` when it is a local folder; empty (the class loads at takeover) for a remote store and a hub id."""
    store, policy = service.store, service.loop.policy
    if store.local:
        versions = store.versions(policy)
        if versions:
            return str(store.path(policy, versions[-1]))
    return service.settings.model if is_local(service.settings.model) else ""


def warm(service) -> None:
    """Place the rank and import what its takeover would: every rank of a standby gang does (rank 0 then waits, the
    others wait for its commands), or the first command would find the other ranks cold."""
    service._place()
    warm_imports(*(["peft"] if service.lora else []), *(["deepspeed"] if "zero" in service.settings.sharding else []),
                 model=model_spec(service))


def stand_by(service, kafka: KafkaSettings, runtime: RuntimeSettings) -> Line | None:
    """Warm, then wait in the policy's line (``kafka.standby``); the place, once first with no live trainer (hold on
    to it), or None when the service was stopped first."""
    warm(service)
    return await_vacancy(kafka, service.group_id, service.loop.policy, runtime.session_timeout_ms,
                         stopping=lambda: service._stopping, who="trainer")
