"""Query the archive: through a running archive's SQL endpoint, or chDB / a ClickHouse server directly.

Embedded chDB admits one process per data path, so while ``rlstream run archive``
owns the path, every other process sends its SQL to that process's endpoint.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import decimal
import json
import math
import os
import re
import secrets
import socket
import sys
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, ClassVar

from rlstream.config import (CLICKHOUSE_PASSWORD_ENV, CLICKHOUSE_USER_ENV, DEFAULT_ARCHIVE, LoopSettings, add_arguments,
                             knob, load)
from rlstream.errors import UserError

ENDPOINT_FILE = "archive-endpoint.json"
TOKEN_HEADER = "X-Rlstream-Token"
DATABASE = "rlstream"
#: Statements that return rows; everything else runs as a command.
_ROW_STATEMENTS = ("select", "with", "show", "desc", "describe", "explain", "exists")
_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


class ArchiveError(UserError):
    """A problem the user can act on (bad SQL, missing or busy archive); printed without a traceback."""


def resolve(url: str | None) -> tuple[str, str]:
    """('chdb', absolute data path) or ('http', server URL) for an archive URL."""
    url = url or DEFAULT_ARCHIVE
    if url.startswith("chdb://"):
        rest = url[len("chdb://"):]
        if not rest:
            raise ValueError("chdb:// needs a data path, e.g. chdb:///var/lib/rlstream or chdb://.rlstream/archive")
        return "chdb", os.path.abspath(os.path.expanduser(rest))
    if url.startswith(("http://", "https://")):
        from urllib.parse import urlsplit
        parts = urlsplit(url)
        if parts.username or parts.password:
            raise ValueError(f"put ClickHouse credentials in {CLICKHOUSE_USER_ENV} / {CLICKHOUSE_PASSWORD_ENV}, "
                             "not in the archive URL")
        return "http", url
    raise ValueError(f"archive must be chdb://PATH, http://HOST:PORT or https://HOST:PORT, got {url!r}")


def connect(url: str | None, create: bool = False):
    """A clickhouse-connect client for the archive; ``create`` allows a new chDB data path."""
    import clickhouse_connect
    kind, where = resolve(url)
    try:
        if kind == "chdb":
            if not create and not Path(where).is_dir():
                raise ArchiveError(f"no archive at {where} (start `rlstream run archive` to create it)")
            Path(where).mkdir(parents=True, exist_ok=True)
            return clickhouse_connect.get_client(dsn=f"chdb://{where}")
        from urllib.parse import urlsplit
        parts = urlsplit(where)
        secure = parts.scheme == "https"
        return clickhouse_connect.get_client(
            host=parts.hostname, port=parts.port or (8443 if secure else 8123), secure=secure,
            username=os.environ.get(CLICKHOUSE_USER_ENV, "default"),
            password=os.environ.get(CLICKHOUSE_PASSWORD_ENV, ""))
    except ArchiveError:
        raise
    except Exception as exc:
        message = clean_error(exc)
        # chDB prints the lock error itself and raises a vaguer one; the endpoint file names the holder.
        holder = read_endpoint(where) if kind == "chdb" else None
        if holder or "Cannot lock file" in message:
            message = (f"the archive at {where} is held by another process"
                       + (f" (pid {holder['pid']}; `rlstream sql` reaches it through its endpoint)" if holder else ""))
        raise ArchiveError(f"cannot open the archive: {message}") from None


def clean_error(exc: BaseException) -> str:
    """One line from a ClickHouse / chDB error: the DB::Exception text without the version trailer."""
    text = str(exc)
    if "DB::Exception:" in text:
        text = text[text.index("DB::Exception:") + len("DB::Exception:"):]
    text = re.sub(r"\s*\(version [^)]*\)\s*$", "", text.strip())
    text = re.sub(r"\s*FORMAT Native\b", "", text)  # clickhouse-connect's own suffix, not the user's SQL
    text = " ".join(text.split())
    return text[:1000] or type(exc).__name__


def jsonable(value: Any) -> Any:
    """A query value as JSON can carry it (the endpoint and direct queries return the same)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return jsonable(value.tolist())
    return str(value)


def run_sql(client, sql: str) -> tuple[list[str], list[list]]:
    """Run one statement on a client: (column names, JSON-ready rows); ArchiveError on failure."""
    statement = sql.strip().rstrip(";").strip()
    if not statement:
        raise ArchiveError("empty SQL")
    try:
        head = _COMMENTS.sub(" ", statement).lstrip("( \n\t").split(None, 1)
        if not head or head[0].lower() in _ROW_STATEMENTS:
            result = client.query(statement)
            return list(result.column_names), [[jsonable(v) for v in row] for row in result.result_rows]
        client.command(statement)
        return [], []
    except ArchiveError:
        raise
    except Exception as exc:
        raise ArchiveError(clean_error(exc)) from None


def read_endpoint(data_path: str) -> dict | None:
    """The running archive's endpoint {pid, port, token} if its process is alive, else None."""
    path = Path(data_path) / ENDPOINT_FILE
    try:
        info = json.loads(path.read_text())
        pid, port = int(info["pid"]), int(info["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid == os.getpid():
        return None  # this process owns the engine itself
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    return {"pid": pid, "port": port, "token": str(info.get("token", ""))}


class Archive:
    """A handle on the archive: ``query(sql) -> (columns, rows)``."""

    def query(self, sql: str) -> tuple[list[str], list[list]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine or connection."""

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EndpointArchive(Archive):
    """SQL sent to the archive process that owns the embedded engine."""

    def __init__(self, port: int, token: str = "", timeout: float = 300.0):
        self.url = f"http://127.0.0.1:{port}/"
        self.token = token
        self.timeout = timeout

    def query(self, sql: str) -> tuple[list[str], list[list]]:
        request = urllib.request.Request(self.url, data=sql.encode("utf-8"), method="POST",
                                         headers={TOKEN_HEADER: self.token, "Content-Type": "text/plain"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", str(exc))
            except ValueError:
                message = str(exc)
            raise ArchiveError(message) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ArchiveError(f"the archive endpoint {self.url} did not answer: {exc}") from None
        return body["columns"], body["rows"]


class DirectArchive(Archive):
    """The archive opened by this process (chDB path or ClickHouse server)."""

    def __init__(self, url: str | None):
        self.client = connect(url)

    def query(self, sql: str) -> tuple[list[str], list[list]]:
        return run_sql(self.client, sql)

    def close(self) -> None:
        self.client.close()


def open_archive(url: str | None = None) -> Archive:
    """The archive at ``url`` (default $RLSTREAM_ARCHIVE, then chdb://.rlstream/archive)."""
    try:
        kind, where = resolve(url)
    except ValueError as exc:
        raise ArchiveError(str(exc)) from None
    if kind == "chdb":
        info = read_endpoint(where)
        if info is not None:
            try:  # a pid reused by another program leaves a dead port: open the path ourselves then
                socket.create_connection(("127.0.0.1", info["port"]), timeout=2).close()
                return EndpointArchive(info["port"], info["token"])
            except OSError:
                pass
    return DirectArchive(url)


class SqlEndpoint:
    """The archive process's side: POST SQL to http://127.0.0.1:PORT/, get JSON {columns, rows} or {error}.

    Announced in <data path>/archive-endpoint.json as {pid, port, token}; requests carry the token.
    """

    def __init__(self, execute: Callable[[str], tuple[list[str], list[list]]], data_path: str | None, port: int = 0):
        self.execute = execute
        self.file = Path(data_path) / ENDPOINT_FILE if data_path else None
        self.token = secrets.token_hex(16)  # keeps other local users from running SQL as the archive's owner
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> int:
        """Serve in a daemon thread and write the endpoint file; returns the port."""
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                if not secrets.compare_digest(self.headers.get(TOKEN_HEADER, ""), endpoint.token):
                    return self._reply(403, {"error": f"bad or missing {TOKEN_HEADER} (see {ENDPOINT_FILE})"})
                try:
                    sql = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode("utf-8")
                    columns, rows = endpoint.execute(sql)
                except (ArchiveError, UnicodeDecodeError) as exc:
                    return self._reply(400, {"error": str(exc)})
                except Exception as exc:  # the endpoint must outlive any one query
                    return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                self._reply(200, {"columns": columns, "rows": rows})

            def do_GET(self):  # noqa: N802
                self._reply(200, {"pid": os.getpid()})

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body, ensure_ascii=False).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="archive-sql", daemon=True).start()
        if self.file is not None:
            tmp = self.file.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "port": self.port, "token": self.token}, f)
            os.replace(tmp, self.file)
        return self.port

    def stop(self) -> None:
        """Stop serving and remove the endpoint file (if it is still ours)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        try:
            if self.file is not None and json.loads(self.file.read_text()).get("pid") == os.getpid():
                self.file.unlink()
        except (OSError, ValueError):
            pass


# -- output -----------------------------------------------------------------------


def _cell(value: Any, width: int = 80) -> str:
    if value is None:
        return "NULL"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "…"


def format_table(columns: list[str], rows: list[list]) -> str:
    """An aligned text table, numbers right-aligned, long cells cut at 80 characters."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows if r[i] is not None)
               for i in range(len(columns))]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def print_result(columns: list[str], rows: list[list], fmt: str, out=sys.stdout) -> None:
    """Print a result as an aligned table, CSV, or one JSON object per row."""
    if not columns:
        print("OK", file=out)
    elif fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else v if isinstance(v, str) else json.dumps(v) for v in row])
    elif fmt == "json":
        for row in rows:
            print(json.dumps(dict(zip(columns, row)), ensure_ascii=False), file=out)
    else:
        print(format_table(columns, rows), file=out)


@dataclass(frozen=True)
class SqlSettings:
    """How ``rlstream sql`` prints."""

    ROLE: ClassVar[str] = "SQL"

    format: str = knob("table", "Output format", choices=("table", "csv", "json"))


def cmd_sql(args: argparse.Namespace) -> None:
    loop, s = load(LoopSettings, args), load(SqlSettings, args)
    sql = args.sql if args.sql != "-" else sys.stdin.read()
    with open_archive(loop.archive) as archive:
        columns, rows = archive.query(sql)
    print_result(columns, rows, s.format)


def add_command(subparsers) -> None:
    """``rlstream sql "SELECT ..." [--archive URL] [--format table|csv|json]``."""
    p = subparsers.add_parser("sql", help="query the archive with SQL (tables live in database rlstream)")
    p.add_argument("sql", help="one SQL statement ('-' reads it from stdin)")
    add_arguments(p, LoopSettings)
    add_arguments(p, SqlSettings)
    p.set_defaults(func=cmd_sql)
