"""The teacher as a vLLM OpenAI-compatible server (``--teacher-url``): the student's sequences scored through
prompt log-probs, many requests in flight.

Each row is one ``POST /v1/completions`` with ``prompt`` as token ids, ``max_tokens`` 1 (the generated token is
discarded) and ``prompt_logprobs`` k: vLLM then returns, at every prompt position, the actual token's log-prob and
the k most likely (by rank). Prompt log-probs are the model's own distribution (temperature 1), as in process
(``scoring.VllmScorer``). Up to ``in_flight`` requests run at once; rows not answered by the batch's deadline come
back as None (status ``timeout`` in the stage), and a row the server refuses (HTTP 4xx) as a ValueError with the
server's reason (dead-lettered). The HTTP plumbing is the inference fleet's (``engine/servers.py``).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time

from rlstream.errors import UserError
from rlstream.engine.servers import TOKENIZER_PROBE, ServerAPI, ServerError

log = logging.getLogger(__name__)


class ServerScorer:
    """A remote teacher: rows of token ids in, (log-prob of each next token, top-k ids, top-k log-probs) out."""

    def __init__(self, url: str, model: str = "", in_flight: int = 32, request_timeout_s: float = 60.0):
        self.api = ServerAPI(url, model, timeout_s=request_timeout_s)
        try:
            self.served = self.api.served_model()
        except ServerError as exc:
            raise UserError(f"teacher server {self.api.url} is unreachable or failing ({exc}); check --teacher-url "
                            "and that the server is up") from None
        if not self.api.model:
            self.api.model = self.api.model_id()
        self.pool = cf.ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="teacher-http")

    @staticmethod
    def supports(temperature: float) -> bool:
        return temperature == 1.0

    def check_tokenizer(self, tokenizer, student: str) -> None:
        """UserError unless the server tokenizes a probe text as the student's tokenizer does (a server without a
        /tokenize route cannot be checked: refused too, since a wrong vocabulary would score nonsense silently)."""
        try:
            theirs = self.api.tokenize(TOKENIZER_PROBE)
        except ServerError as exc:
            raise UserError(f"teacher server {self.api.url} failed to tokenize a probe text: {exc}") from None
        if theirs is None:
            raise UserError(f"teacher server {self.api.url} has no /tokenize route: cannot check that {self.served} "
                            f"shares {student}'s tokenizer; serve the teacher with vLLM's OpenAI server")
        ours = list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
        if theirs != ours:
            raise UserError(f"teacher server {self.api.url} serves {self.served}, whose tokenizer is not {student}'s "
                            f"(the probe text is {theirs[:8]}... there, {ours[:8]}... here); serve a teacher with "
                            "the student's tokenizer (--align-tokenizers needs a teacher folder, --teacher)")

    def score(self, rows: list[list[int]], temperature: float, k: int,
              deadline: float | None = None) -> list[tuple[list[float], list, list] | ValueError | None]:
        """As ``TorchScorer.score``, at temperature 1: each row's arrays, None where the deadline came first, or a
        ValueError for a row the server refused."""
        if not self.supports(temperature):
            raise ValueError(f"the vLLM teacher server scores at temperature 1, not {temperature}")
        futures = [self.pool.submit(self._one, row, k) for row in rows]
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        cf.wait(futures, timeout=wait)
        out: list = []
        for fut in futures:
            if not fut.done():
                fut.cancel()  # not started yet: never sent; a request in flight is left to finish, unread
                out.append(None)
            elif isinstance(fut.exception(), ServerError) and not fut.exception().retryable:
                out.append(ValueError(f"the teacher server refused the sequence: {fut.exception()}"))
            elif fut.exception() is not None:  # unreachable, failing or unreadable: on without feedback
                log.warning("teacher server %s: %s; the sample goes on as timeout", self.api.url, fut.exception())
                out.append(None)
            else:
                out.append(fut.result())
        return out

    def _one(self, row: list[int], k: int) -> tuple[list[float], list, list]:
        reply = self.api._call("POST", "/v1/completions", {
            "model": self.api.model, "prompt": row, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k,
            "return_token_ids": True})
        return from_prompt_logprobs(row, reply["choices"][0]["prompt_logprobs"], k)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def from_prompt_logprobs(row: list[int], prompt_logprobs: list, k: int) -> tuple[list[float], list, list]:
    """The server's per-position JSON (None at position 0, then ``{"<token id>": {"logprob", "rank", ...}}`` with
    the actual token's entry besides the top k) as (log-prob of each next token, top-k ids and log-probs by rank)."""
    if len(prompt_logprobs) != len(row):
        raise ValueError(f"the teacher server returned {len(prompt_logprobs)} prompt positions for {len(row)} tokens")
    lps, ids, tlps = [], [], []
    for t in range(1, len(row)):
        entries = {int(token): e for token, e in prompt_logprobs[t].items()}
        lps.append(float(entries[row[t]]["logprob"]))
        if k:
            best = sorted(entries.items(), key=lambda e: e[1]["rank"])[:k]
            ids.append([token for token, _ in best])
            tlps.append([float(e["logprob"]) for _, e in best])
    return lps, (ids if k else None), (tlps if k else None)
