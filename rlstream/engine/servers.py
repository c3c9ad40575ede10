"""One inference server over HTTP: how a request and its response map to rlstream's Generation, how new weights
are pushed to it, and how its health and its tokenizer are checked.

- ``vllm-server``: vLLM's OpenAI-compatible server. ``/v1/completions`` with the prompt as token ids,
  ``logprobs: 0`` (the sampled token's log-prob) and ``return_token_ids``. Weights: ``POST /collective_rpc``
  ``{"method": "reload_weights", "kwargs": {"weights_path": FOLDER}}`` (it returns once every worker has
  loaded), then ``POST /reset_prefix_cache`` (no prompt KV of the old weights is reused) and
  ``POST /update_weight_version`` (the server then names the version it holds, ``GET /weight_info``).
  These are vLLM's dev-mode routes: start the server with ``VLLM_SERVER_DEV_MODE=1``. A model with tied embeddings
  needs ``--worker-extension-cls rlstream.engine.vllm_worker.RLStreamWorker`` too: after each reload the push calls
  its ``rlstream_refresh_tied_head`` (``engine.vllm_worker``). A LoRA version (``rlstream.policy.adapters``) goes
  in as an adapter over the base the server was started on: ``POST /v1/load_lora_adapter`` under a name of its own
  per version (``rlstream-v<N>``, never reused: the prefix cache is keyed by the adapter's name, so a reused name
  could mix two versions' KV), after which requests and the load probe name it as their model; the oldest beyond
  ``ADAPTERS_KEPT`` are unloaded. Start the server with ``--enable-lora --max-lora-rank R`` (R at least the
  trainer's ``--lora-rank``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
- Every kind that takes weights answers the load probe (``probe_logprobs``: the prompt's own log-probs, vLLM's
  ``echo`` or SGLang's ``input_token_logprobs``), which the fleet checks after each push (``policy.probe``).
- ``sglang``: SGLang's native ``/generate`` with ``input_ids`` and ``return_logprob``; tokens and log-probs come
  from ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per token). Weights:
  ``POST /update_weights_from_disk`` ``{"model_path": FOLDER, "weight_version": "N"}`` (``success`` and
  ``message`` in the reply); each response's ``meta_info.weight_version`` is checked against the version recorded
  at dispatch. A LoRA version: ``POST /load_lora_adapter`` under its own name, which each ``/generate`` then names
  in ``lora_path``. Untested against a live server here (no CPU build): the mapping follows SGLang's documented API.
- ``openai``: any OpenAI-compatible ``/v1/completions`` endpoint that returns token ids and log-probs, for serving
  only: rlstream cannot push weights to it, so its tokens carry the version the operator pins.

The weights folder is a path *on the server's machine*: a server on this host reads the rollout's materialised
folder; a remote one needs a shared path (or the store mounted at the same path).
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rlstream.schemas.records import SamplingParams
from rlstream.engine.base import Generation

log = logging.getLogger(__name__)

#: Text tokenized by the server and by the policy's tokenizer: equal ids mean the same tokenizer (digits, spaces,
#: punctuation and non-ASCII catch most vocabulary differences).
TOKENIZER_PROBE = "rlstream probe: 12 + 30 = 42; déjà vu, 東京! <|im_end|>"


class ServerError(OSError):
    """An HTTP error reply; ``status`` 0 when the server could not be reached at all."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: {'HTTP ' + str(status) if status else 'unreachable'}: {message}")
        self.url, self.status, self.message = url, status, message

    @property
    def retryable(self) -> bool:
        """Worth sending again, to this or another server: unreachable, overloaded, or a server-side failure."""
        return self.status == 0 or self.status == 429 or self.status >= 500


class PushRejected(OSError):
    """A server did not load a version: it stays on the weights it had."""


class Call:
    """A handle on one request in progress that another thread may cancel: its connection is shut, the waiting
    thread gets a ServerError (``cancelled`` then says it was ours), and the server drops the request (vLLM aborts a
    completion whose client went away)."""

    def __init__(self):
        self.cancelled = False
        self._lock = threading.Lock()
        self._conns: list[http.client.HTTPConnection] = []

    def attach(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conns.append(conn)
            if self.cancelled:
                _shut(conn)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            for conn in self._conns:
                _shut(conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    # The waiting thread blocks in a read on this socket: shutting it down (not just closing) wakes that read.
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass


def _opener(call: Call) -> urllib.request.OpenerDirector:
    """urllib's usual opener (proxies included), whose connections are handed to ``call`` once connected (a
    cancel before then shuts the connection as soon as it is made)."""

    def tracked(cls):
        class Tracked(cls):
            def connect(self):
                super().connect()
                call.attach(self)
        return Tracked

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(tracked(http.client.HTTPConnection), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(tracked(http.client.HTTPSConnection), req, context=self._context)

    return urllib.request.build_opener(HTTP, HTTPS)


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0, headers: dict | None = None,
              call: Call | None = None, text: bool = False) -> Any:
    """One JSON request; ServerError on an HTTP error status or no connection; None for an empty reply. ``call``:
    a handle that can cancel it from another thread. ``text``: the reply is text, not JSON (vLLM's LoRA routes)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with (_opener(call).open(req, timeout=timeout) if call else urllib.request.urlopen(req, timeout=timeout)) \
                as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise ServerError(url, exc.code, exc.read().decode(errors="replace")[:500]) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, reset, cut short, timeout
        raise ServerError(url, 0, str(getattr(exc, "reason", exc)) or type(exc).__name__) from None
    if text:
        return raw.decode(errors="replace")
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:  # a reply cut off mid-body by a dying server
        raise ServerError(url, 0, f"unreadable reply: {raw[:200]!r}") from None


#: LoRA adapters a server keeps loaded: the version it serves and two before it (catch-ups of a fleet, retries).
ADAPTERS_KEPT = 3


class ServerAPI:
    """The requests one kind of server understands; subclasses map them. ``url`` is the server's base URL."""

    kind = "server"
    #: Whether rlstream can push weights to it (and so confirm the version of its tokens).
    pushes = True
    #: Whether it takes a LoRA version as an adapter over the base it holds (``push_adapter``).
    serves_adapters = False

    def __init__(self, url: str, model: str = "", timeout_s: float = 300.0, push_timeout_s: float = 600.0,
                 api_key: str = ""):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.push_timeout_s = push_timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(self, method: str, path: str, body: Any = None, timeout: float | None = None,
              call: Call | None = None, text: bool = False) -> Any:
        return http_json(method, self.url + path, body, timeout or self.timeout_s, self.headers, call, text)

    # -- generation -------------------------------------------------------------------------

    def request(self, prompt: list[int], params: SamplingParams) -> tuple[str, dict]:
        """The path and JSON body that sample one continuation of ``prompt``."""
        raise NotImplementedError

    def parse(self, reply: dict) -> tuple[Generation, str | None]:
        """The Generation in a reply (versions left empty), and the weight version the server says made it
        (None when it does not say)."""
        raise NotImplementedError

    def generate(self, prompt: list[int], params: SamplingParams,
                 call: Call | None = None) -> tuple[Generation, str | None]:
        """One sampled continuation; ``call`` lets another thread cancel it (a ServerError then)."""
        path, body = self.request(prompt, params)
        return self.parse(self._call("POST", path, body, call=call))

    # -- weights, health, identity ----------------------------------------------------------

    def push(self, folder: Path, version: int) -> None:
        """Load ``folder`` as ``version``; returns only once the server has loaded it. PushRejected if it refused."""
        raise PushRejected(f"{self.url}: a {self.kind} endpoint takes no weights from rlstream")

    def push_adapter(self, folder: Path, version: int) -> None:
        """Serve ``version``, a LoRA adapter folder, over the base the server holds; returns once it is loaded.
        PushRejected if it refused."""
        raise PushRejected(f"{self.url}: a {self.kind} server takes no LoRA adapters from rlstream")

    def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        """The server's log-prob of each of ``token_ids[1:]`` after the tokens before it (the load probe); None
        when it cannot say (ServerError when it fails)."""
        return None

    def healthy(self) -> bool:
        try:
            self._call("GET", "/health", timeout=5)
            return True
        except (ServerError, ValueError):
            return False

    def served_model(self) -> str:
        """The model the server says it serves (raises ServerError when unreachable)."""
        models = self._call("GET", "/v1/models", timeout=10).get("data") or [{}]
        return str(models[0].get("root") or models[0].get("id") or "?")

    def model_id(self) -> str:
        """The name requests must carry to reach the served model."""
        models = self._call("GET", "/v1/models", timeout=10).get("data") or [{}]
        return str(models[0].get("id") or "")

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for ``text`` without special tokens; None when it offers no tokenizer route."""
        try:
            reply = self._call("POST", "/tokenize", {"model": self.model, "prompt": text,
                                                     "add_special_tokens": False}, timeout=10)
        except ServerError as exc:
            if exc.status in (404, 405):
                return None
            raise
        return [int(t) for t in reply["tokens"]]


def _tied(folder) -> bool:
    """Whether the checkpoint in ``folder`` ties its output head to its input embeddings; True when its config is
    not readable here (a path on the server's machine only): then the server is asked anyway."""
    try:
        return bool(json.loads((Path(folder) / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return True


def _finite(x) -> float:
    # A log-prob of -inf (a token outside top-p) is serialised as null or a huge negative; keep it finite.
    return float(x) if x is not None and math.isfinite(float(x)) else -1e9


class OpenAICompletionsAPI(ServerAPI):
    """Any OpenAI-compatible /v1/completions endpoint that echoes token ids and log-probs (serving only)."""

    kind = "openai"
    pushes = False

    def request(self, prompt, params):
        body = {"model": self.model, "prompt": prompt, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if params.top_k and params.top_k > 0:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        return "/v1/completions", body

    def parse(self, reply):
        choice = reply["choices"][0]
        lp = choice.get("logprobs") or {}
        # Token ids: vLLM's return_token_ids, else "token_id:N" strings (return_tokens_as_token_ids).
        ids = choice.get("token_ids")
        if ids is None:
            ids = [int(t.split(":", 1)[1]) for t in lp.get("tokens", [])]
        lps = [_finite(x) for x in lp.get("token_logprobs") or []]
        if len(lps) != len(ids):
            raise ValueError(f"{self.url} returned {len(ids)} tokens but {len(lps)} log-probs; the endpoint must "
                             "support logprobs and return token ids")
        return Generation(list(ids), lps, "stop" if choice.get("finish_reason") == "stop" else "length"), None

    def healthy(self) -> bool:
        # A hosted endpoint may have no /health; listing models is the cheapest call every one answers.
        try:
            self.served_model()
            return True
        except (ServerError, ValueError, KeyError, AttributeError):
            return False


class VLLMServerAPI(OpenAICompletionsAPI):
    """vLLM's OpenAI-compatible server, with weight pushes through its dev-mode routes."""

    kind = "vllm-server"
    pushes = True
    serves_adapters = True
    #: Whether the server has rlstream's worker extension (``engine.vllm_worker``); False once it said it has not.
    refreshes = True
    #: The adapters it holds, oldest first (``push_adapter``); the model name of its base, while one is served.
    adapters: tuple[str, ...] = ()
    base_model = ""

    def push_adapter(self, folder, version):
        name = f"rlstream-v{version}"
        try:
            if name not in self.adapters:
                self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)},
                           timeout=self.push_timeout_s, text=True)  # it answers in text: "Success: ..."
        except ServerError as exc:
            raise PushRejected(f"{self.url} did not load the adapter of v{version} from {folder}: {exc.message[:300]} "
                               "(start vLLM with --enable-lora --max-lora-rank R, R at least the trainer's "
                               "--lora-rank, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)") from None
        self.base_model = self.base_model or self.model
        self.model = name  # every request, and the load probe, go to this version's adapter from now on
        self.adapters = (*(a for a in self.adapters if a != name), name)
        while len(self.adapters) > ADAPTERS_KEPT:
            old, self.adapters = self.adapters[0], self.adapters[1:]
            try:
                self._call("POST", "/v1/unload_lora_adapter", {"lora_name": old}, timeout=60, text=True)
            except ServerError as exc:  # it only holds one more adapter than it needs
                log.warning("%s did not unload adapter %s: %s", self.url, old, exc.message[:200])

    def push(self, folder, version):
        if self.base_model:  # whole weights again: requests go to the base model, no adapter
            self.model, self.base_model = self.base_model, ""
        try:
            self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": str(folder)}},
                       timeout=self.push_timeout_s)
            self._refresh_tied_head(folder)
            # Prefixes cached under the old weights must not seed new requests.
            self._call("POST", "/reset_prefix_cache", timeout=60)
            self._call("POST", "/update_weight_version", {"new_version": str(version)}, timeout=60)
        except ServerError as exc:
            hint = (" (start vLLM with VLLM_SERVER_DEV_MODE=1 for its weight routes)" if exc.status == 404 else "")
            raise PushRejected(f"{self.url} did not load v{version} from {folder}: {exc.message[:300]}{hint}") from None

    def probe_logprobs(self, token_ids):
        # echo with logprobs: the prompt's own tokens come back first with their log-probs (the first has none).
        reply = self._call("POST", "/v1/completions", {
            "model": self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0, "echo": True,
            "logprobs": 0}, timeout=60)
        lps = ((reply.get("choices") or [{}])[0].get("logprobs") or {}).get("token_logprobs") or []
        if len(lps) < len(token_ids):
            raise ValueError(f"{self.url} echoed {len(lps)} prompt log-probs for a {len(token_ids)}-token probe")
        return [_finite(x) for x in lps[1:len(token_ids)]]

    def _refresh_tied_head(self, folder) -> None:
        """A tied output head is not refreshed by ``reload_weights`` on vLLM's CPU build (``engine.vllm_worker``):
        the server refreshes it if it was started with rlstream's worker extension. Without it, said once; the load
        probe then tells whether what the server serves is the version."""
        if not self.refreshes or not _tied(folder):
            return
        try:
            self._call("POST", "/collective_rpc", {"method": "rlstream_refresh_tied_head"}, timeout=60)
        except ServerError as exc:
            if exc.status in (0, 404):
                raise
            self.refreshes = False
            log.warning("%s cannot refresh a tied output head after a reload (start it with --worker-extension-cls "
                        "rlstream.engine.vllm_worker.RLStreamWorker); the load probe checks what it serves: %s",
                        self.url, exc.message[:200])

    def weight_version(self) -> str | None:
        """The version the server says it holds (dev mode), None if it cannot say."""
        try:
            return str(self._call("GET", "/weight_info", timeout=10).get("weight_version"))
        except (ServerError, ValueError, AttributeError):
            return None


class SGLangAPI(ServerAPI):
    """SGLang's native API (``/generate``, ``/update_weights_from_disk``, ``/get_model_info``; LoRA versions through
    ``/load_lora_adapter``, each request naming its adapter in ``lora_path``)."""

    kind = "sglang"
    serves_adapters = True
    adapters: tuple[str, ...] = ()  # oldest first; the last is the one requests name

    def _with_adapter(self, body: dict) -> dict:
        return {**body, "lora_path": self.adapters[-1]} if self.adapters else body

    def request(self, prompt, params):
        sampling = {"max_new_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
        if params.top_k and params.top_k > 0:
            sampling["top_k"] = params.top_k
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return "/generate", self._with_adapter({"input_ids": prompt, "sampling_params": sampling,
                                                "return_logprob": True, "logprob_start_len": -1})

    def push_adapter(self, folder, version):
        # Untested against a live server (no CPU build here): SGLang's documented /load_lora_adapter, which answers
        # success and error_message; start SGLang with --enable-lora --max-lora-rank R --lora-target-modules all.
        name = f"rlstream-v{version}"
        if name not in self.adapters:
            try:
                reply = self._call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)},
                                   timeout=self.push_timeout_s) or {}
            except ServerError as exc:
                raise PushRejected(f"{self.url} did not load the adapter of v{version} from {folder}: "
                                   f"{exc.message[:300]} (start SGLang with --enable-lora)") from None
            if not reply.get("success"):
                raise PushRejected(f"{self.url} did not load the adapter of v{version} from {folder}: "
                                   f"{reply.get('error_message')!r}")
        self.adapters = (*(a for a in self.adapters if a != name), name)
        while len(self.adapters) > ADAPTERS_KEPT:
            old, self.adapters = self.adapters[0], self.adapters[1:]
            try:
                self._call("POST", "/unload_lora_adapter", {"lora_name": old}, timeout=60)
            except ServerError as exc:
                log.warning("%s did not unload adapter %s: %s", self.url, old, exc.message[:200])

    def parse(self, reply):
        if isinstance(reply, list):  # a batch reply; we send one prompt per request
            reply = reply[0]
        meta = reply.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise ValueError(f"{self.url} returned no meta_info.output_token_logprobs; send return_logprob")
        ids = [int(p[1]) for p in pairs]
        if "output_ids" in reply and list(reply["output_ids"]) != ids:
            raise ValueError(f"{self.url}: output_ids and output_token_logprobs disagree")
        finish = (meta.get("finish_reason") or {}).get("type")
        # Its weight_version names the base's weights; under an adapter it says nothing of the version served.
        version = None if self.adapters else meta.get("weight_version")
        return (Generation(ids, [_finite(p[0]) for p in pairs], "stop" if finish == "stop" else "length"),
                None if version is None else str(version))

    def push(self, folder, version):
        self.adapters = ()  # whole weights: requests name no adapter
        try:
            reply = self._call("POST", "/update_weights_from_disk",
                               {"model_path": str(folder), "weight_version": str(version)},
                               timeout=self.push_timeout_s) or {}
        except ServerError as exc:
            raise PushRejected(f"{self.url} did not load v{version} from {folder}: {exc.message[:300]}") from None
        if not reply.get("success"):
            raise PushRejected(f"{self.url} did not load v{version} from {folder}: {reply.get('message')!r}")

    def probe_logprobs(self, token_ids):
        # Untested against a live server (no CPU build here): SGLang's documented input_token_logprobs, from
        # logprob_start_len 0, as [logprob, token_id, text] per prompt token (the first has none).
        reply = self._call("POST", "/generate", self._with_adapter({
            "input_ids": list(token_ids), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}), timeout=60)
        if isinstance(reply, list):
            reply = reply[0]
        pairs = (reply.get("meta_info") or {}).get("input_token_logprobs") or []
        if len(pairs) < len(token_ids):
            raise ValueError(f"{self.url} returned {len(pairs)} input log-probs for a {len(token_ids)}-token probe")
        return [_finite(p[0]) for p in pairs[1:len(token_ids)]]

    def model_id(self) -> str:
        return ""  # the native API serves one model and takes no name

    def served_model(self) -> str:
        info = self._call("GET", "/get_model_info", timeout=10)
        return str(info.get("model_path") or info.get("tokenizer_path") or "?")

    def weight_version(self) -> str | None:
        try:
            version = self._call("GET", "/get_model_info", timeout=10).get("weight_version")
        except (ServerError, ValueError, AttributeError):
            return None
        return None if version is None else str(version)


APIS = {"vllm-server": VLLMServerAPI, "sglang": SGLangAPI, "openai": OpenAICompletionsAPI}
