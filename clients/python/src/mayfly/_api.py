"""The manager's requests and answers, with no I/O: the blocking client (``mayfly``) and the
asyncio one (``mayfly.aio``) build the same :class:`Call` for each operation and parse its
answer with the same code, so the two cannot drift apart. Only sending it differs.

The wire format is ``mayfly serve``'s (its OpenAPI document is ``GET /openapi.json``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import stat
import re
import secrets
from dataclasses import dataclass, field
from typing import (
    IO,
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
)
from urllib.parse import quote

from .errors import CommandError, MayflyError, error_for

#: A command: a string runs with ``/bin/sh -c``, a sequence is the program and its arguments.
Command = Union[str, Sequence[str]]
#: What a file can be written from.
Data = Union[bytes, bytearray, memoryview, str, IO[bytes]]

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

#: How long a request waits for its answer unless told otherwise (a create may build a
#: template: a boot, its setup and a snapshot).
DEFAULT_TIMEOUT = 600.0
#: Added to an exec's own timeout for the socket's: the agent's SIGKILL comes 2 s after its
#: SIGTERM, and a sleeping sandbox wakes first.
EXEC_MARGIN = 60.0


def new_name(prefix: str = "sb") -> str:
    """A fresh sandbox name (a DNS label)."""
    return f"{prefix}-{secrets.token_hex(4)}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"{name!r} is not a sandbox name: use a DNS label "
            "(lower-case letters, digits and '-', 1 to 63 of them, not starting or ending with '-')"
        )
    return name


@dataclass(frozen=True)
class Template:
    """What a sandbox is made from. The manager boots it once, runs ``setup`` (shell commands,
    in order, each must exit 0), snapshots it and caches the snapshot under the hash of all of
    this; a sandbox created from it is a restore of that snapshot. Fields left ``None`` take
    the manager's defaults (the built-in guest)."""

    setup: Sequence[str] = ()
    mem_mib: Optional[int] = None
    vcpus: Optional[int] = None
    rootfs: Optional[str] = None
    kernel: Optional[str] = None
    initrd: Optional[str] = None
    cmdline: Optional[str] = None
    #: The egress policy the setup runs under (as ``mayfly run --net``): the template then has
    #: a NIC, and each sandbox made from it the policy its own create names (default none).
    network: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.setup:
            if isinstance(self.setup, str):
                raise TypeError("Template.setup is a list of shell commands, not one string")
            out["setup"] = list(self.setup)
        for key in ("mem_mib", "vcpus", "rootfs", "kernel", "initrd", "cmdline"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.network is not None:
            out["net"] = self.network
        return out


@dataclass
class Result:
    """A command's verdict. ``stdout``/``stderr`` are text (bytes that are not UTF-8 are
    replaced; the exact bytes are in ``stdout_bytes``/``stderr_bytes``). Past the manager's
    limit for a non-streamed exec the rest of a stream is counted in ``*_dropped``, not kept;
    stream (``on_stdout=``) to see all of it."""

    command: Command
    exit_code: Optional[int]
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    signal: Optional[int] = None
    timed_out: bool = False
    wall_ms: float = 0.0
    user_cpu_ms: float = 0.0
    sys_cpu_ms: float = 0.0
    max_rss_kib: int = 0
    error: Optional[str] = None
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    pid: Optional[int] = None

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """It exited with status 0."""
        return self.exit_code == 0

    def check(self) -> "Result":
        """This result, or :class:`~mayfly.CommandError` if the command did not exit 0."""
        if not self.ok:
            raise CommandError(self)
        return self

    def _exit(self, record: Mapping[str, Any]) -> None:
        self.exit_code = record.get("exit_code")
        self.signal = record.get("signal")
        self.timed_out = bool(record.get("timed_out", False))
        self.wall_ms = float(record.get("wall_ms") or 0.0)
        self.user_cpu_ms = float(record.get("user_cpu_ms") or 0.0)
        self.sys_cpu_ms = float(record.get("sys_cpu_ms") or 0.0)
        self.max_rss_kib = int(record.get("max_rss_kib") or 0)
        self.error = record.get("error")


@dataclass(frozen=True)
class Entry:
    """One entry of a guest directory (symlinks are not followed)."""

    name: str
    type: str
    size: int
    mode: int
    mtime_ms: int


@dataclass(frozen=True)
class Stat:
    """A guest file's metadata."""

    type: str
    size: int
    mode: int
    mtime_ms: int
    uid: int
    gid: int


Parse = Callable[[int, bytes], Any]


def _json(status: int, body: bytes) -> Any:
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError as e:
        raise MayflyError(
            f"the manager answered {status} with a body that is not JSON ({e}): {body[:200]!r}",
            status,
        ) from None


@dataclass
class Call:
    """One request: what to send, whose token it needs, and how to read the answer."""

    method: str
    path: str
    body: Optional[Union[bytes, IO[bytes]]] = None
    length: Optional[int] = None
    admin: bool = False
    timeout: Optional[float] = DEFAULT_TIMEOUT
    parse: Parse = _json
    #: A streamed exec: every NDJSON line of the answer goes to it.
    stream: Optional["ExecStream"] = None
    #: Where a file read's bytes go (instead of into memory).
    sink: Optional[IO[bytes]] = None
    headers: Dict[str, str] = field(default_factory=dict)


def raise_for(status: int, body: bytes) -> None:
    """Nothing for a success; the manager's error, as an exception, otherwise."""
    if 200 <= status < 300:
        return
    message = body.decode("utf-8", "replace").strip()
    try:
        value = json.loads(body)
        if isinstance(value, dict) and isinstance(value.get("error"), str):
            message = value["error"]
    except ValueError:
        pass
    raise error_for(status, message or f"the manager answered {status} with no message")


def _q(**params: Any) -> str:
    parts = []
    for key, value in params.items():
        if value is None or value is False:
            continue
        if value is True:
            value = "1"
        parts.append(f"{key}={quote(str(value), safe='')}")
    return ("?" + "&".join(parts)) if parts else ""


def sandbox_path(name: str, tail: str = "") -> str:
    return f"/sandboxes/{quote(check_name(name), safe='')}{tail}"


# --- the manager's routes ------------------------------------------------------------------


def create(
    name: str,
    template: Union[Template, Mapping[str, Any], None],
    idle_timeout: Optional[float],
    network: Optional[str],
    snapshot: Optional[str],
    extra: Mapping[str, Any],
) -> Call:
    spec: Dict[str, Any] = {"name": check_name(name)}
    if template is not None:
        spec["template"] = template.to_json() if isinstance(template, Template) else dict(template)
    if snapshot is not None:
        spec["snapshot"] = os.fspath(snapshot)
    if idle_timeout is not None:
        spec["idle_timeout_s"] = _whole_seconds(idle_timeout, "idle_timeout")
    if network is not None:
        spec["net"] = network
    spec.update(extra)
    return Call("POST", "/sandboxes", _body(spec), admin=True)


def _whole_seconds(value: float, what: str) -> int:
    if value < 0:
        raise ValueError(f"{what} must be 0 or more seconds, not {value}")
    return int(round(value))


def agentless(described: Mapping[str, Any]) -> bool:
    """Whether a sandbox's guest has no agent to wait for (the probe benchmark's, or one made
    with ``no_agent``: the manager answers its guest routes 409 at once)."""
    spec = described.get("spec") or {}
    return bool(
        spec.get("probe") or spec.get("no_agent") or (spec.get("template") or {}).get("probe")
    )


def list_sandboxes() -> Call:
    return Call("GET", "/sandboxes", admin=True, parse=lambda s, b: _json(s, b)["sandboxes"])


def describe(name: str) -> Call:
    return Call("GET", sandbox_path(name))


def delete(name: str) -> Call:
    return Call("DELETE", sandbox_path(name))


def pause(name: str) -> Call:
    return Call("PUT", sandbox_path(name, "/pause"))


def resume(name: str) -> Call:
    return Call("PUT", sandbox_path(name, "/resume"))


def renew_token(name: str) -> Call:
    return Call(
        "PUT", sandbox_path(name, "/token"), admin=True, parse=lambda s, b: _json(s, b)["token"]
    )


def revoke_token(name: str) -> Call:
    return Call("DELETE", sandbox_path(name, "/token"), admin=True)


def fork(
    name: str, count: Optional[int], names: Optional[Sequence[str]], idle_timeout: Optional[float]
) -> Call:
    body: Dict[str, Any] = {}
    if names is not None:
        if isinstance(names, str):
            raise TypeError("names is a list of sandbox names, not one string")
        body["names"] = [check_name(n) for n in names]
        if count is not None and count != len(body["names"]):
            raise ValueError(f"fork(n={count}) with {len(body['names'])} names: give one of them")
    elif count is not None:
        if count < 1:
            raise ValueError(f"fork(n={count}): n must be 1 or more")
        body["count"] = count
    else:
        body["count"] = 1
    if idle_timeout is not None:
        body["idle_timeout_s"] = _whole_seconds(idle_timeout, "idle_timeout")
    return Call("POST", sandbox_path(name, "/fork"), _body(body), admin=True)


def set_policy(name: str, policy: str) -> Call:
    if not isinstance(policy, str) or not policy:
        raise ValueError("a policy is none, open, or allow=CIDR[:PORT]|NAME[:PORT],...")
    return Call("PUT", sandbox_path(name, "/vm/net/policy"), _body({"policy": policy}), admin=True)


def expose_port(name: str, guest_port: int, host: Optional[str]) -> Call:
    if not isinstance(guest_port, int) or not 1 <= guest_port <= 65535:
        raise ValueError(f"guest port {guest_port!r}: give 1 to 65535")
    body: Dict[str, Any] = {"guest_port": guest_port}
    if host is not None:
        body["host"] = host
    return Call("POST", sandbox_path(name, "/ports"), _body(body), admin=True)


def list_ports(name: str) -> Call:
    return Call("GET", sandbox_path(name, "/ports"), parse=lambda s, b: _json(s, b)["ports"])


def close_port(name: str, guest_port: int) -> Call:
    if not isinstance(guest_port, int) or not 1 <= guest_port <= 65535:
        raise ValueError(f"guest port {guest_port!r}: give 1 to 65535")
    return Call("DELETE", sandbox_path(name, f"/ports/{guest_port}"), admin=True)


def snapshot(name: str, path: str) -> Call:
    return Call(
        "PUT", sandbox_path(name, "/vm/snapshot"), _body({"path": os.fspath(path)}), admin=True
    )


def agent(name: str, timeout: float) -> Call:
    return Call("GET", sandbox_path(name, "/vm/agent"), timeout=timeout)


def verify_credential(credential: str, audience: Optional[str] = None) -> Call:
    body: Dict[str, Any] = {"credential": credential}
    if audience is not None:
        body["audience"] = audience
    return Call("POST", "/credentials/verify", _body(body), admin=True)


def mint_credential(name: str, audience: Optional[str], ttl: Optional[float]) -> Call:
    body: Dict[str, Any] = {}
    if audience is not None:
        if not isinstance(audience, str) or not audience:
            raise ValueError(f"audience {audience!r}: give a non-empty string")
        body["audience"] = audience
    if ttl is not None:
        body["ttl_s"] = _whole_seconds(ttl, "ttl")
        if body["ttl_s"] < 1:
            raise ValueError(f"ttl {ttl!r}: a credential lives at least 1 second")
    return Call("POST", sandbox_path(name, "/credential"), _body(body), admin=True)


def revoke_credential(name: str) -> Call:
    return Call("DELETE", sandbox_path(name, "/credential"), admin=True)


def metrics() -> Call:
    return Call("GET", "/metrics", admin=True, parse=lambda s, b: b.decode("utf-8", "replace"))


# --- in the guest ----------------------------------------------------------------------------


def exec_call(
    name: str,
    cmd: Command,
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout: Optional[float],
    stdin: Optional[Union[str, bytes]],
    user: Optional[Union[str, int]],
    on_stdout: Optional[Callable[[str], None]],
    on_stderr: Optional[Callable[[str], None]],
) -> Call:
    body: Dict[str, Any] = {}
    if isinstance(cmd, str):
        body["shell"] = cmd
    else:
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("cmd is a shell command (str) or a non-empty list of strings")
        body["argv"] = argv
    if env:
        body["env"] = {str(k): str(v) for k, v in env.items()}
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    socket_timeout: Optional[float] = None
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be more than 0 seconds, not {timeout}")
        body["timeout_ms"] = max(1, int(timeout * 1000))
        socket_timeout = timeout + EXEC_MARGIN
    if isinstance(stdin, str):
        body["stdin"] = stdin
    elif stdin is not None:
        body["stdin_base64"] = base64.b64encode(bytes(stdin)).decode()
    call = Call("POST", sandbox_path(name, "/vm/exec"), timeout=socket_timeout)
    if on_stdout is not None or on_stderr is not None:
        body["stream"] = True
        call.stream = ExecStream(cmd, on_stdout, on_stderr)
        call.parse = lambda s, b: call.stream.result()  # type: ignore[union-attr]
    else:
        call.parse = lambda s, b: exec_result(cmd, _json(s, b))
    call.body, call.length = _body(body), None
    return call


def exec_result(cmd: Command, answer: Mapping[str, Any]) -> Result:
    result = Result(cmd, None)
    result._exit(answer.get("exit") or {})
    result.stdout_bytes = _stream_bytes(answer, "stdout")
    result.stderr_bytes = _stream_bytes(answer, "stderr")
    result.stdout_dropped = int(answer.get("stdout_dropped") or 0)
    result.stderr_dropped = int(answer.get("stderr_dropped") or 0)
    return result


def _stream_bytes(answer: Mapping[str, Any], name: str) -> bytes:
    text = answer.get(name)
    if isinstance(text, str):
        return text.encode()
    if isinstance(answer.get(f"{name}_base64"), str):
        return base64.b64decode(answer[f"{name}_base64"])
    return b""


class ExecStream:
    """A streamed exec's answer, one NDJSON line at a time: output goes to the callbacks as it
    comes (and is kept for the result); the last line is the exit record or an error."""

    def __init__(
        self,
        cmd: Command,
        on_stdout: Optional[Callable[[str], None]],
        on_stderr: Optional[Callable[[str], None]],
    ) -> None:
        self._result = Result(cmd, None)
        self._out: List[bytes] = []
        self._err: List[bytes] = []
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._done = False
        self._error: Optional[str] = None

    def feed(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            event = json.loads(line)
        except ValueError:
            raise MayflyError(f"a streamed exec sent a line that is not JSON: {line[:200]!r}")
        if not isinstance(event, dict):
            raise MayflyError(f"a streamed exec sent {event!r}, not an object")
        for name, kept in (("stdout", self._out), ("stderr", self._err)):
            if isinstance(event.get(name), str):
                data = event[name].encode()
            elif isinstance(event.get(f"{name}_base64"), str):
                data = base64.b64decode(event[f"{name}_base64"])
            else:
                continue
            kept.append(data)
            callback = self._callbacks[name]
            if callback is not None:
                callback(data.decode("utf-8", "replace"))
        if isinstance(event.get("started"), dict):
            self._result.pid = event["started"].get("pid")
        if isinstance(event.get("exit"), dict):
            self._result._exit(event["exit"])
            self._done = True
        if "error" in event:
            self._error = str(event["error"])
            self._done = True

    def result(self) -> Result:
        if self._error is not None:
            raise error_for(502, f"the exec failed in the guest: {self._error}")
        if not self._done:
            raise MayflyError(
                "the streamed exec ended without an exit record: the sandbox's VMM or the "
                "manager went away mid-command (see the manager's events.jsonl)"
            )
        self._result.stdout_bytes = b"".join(self._out)
        self._result.stderr_bytes = b"".join(self._err)
        return self._result


def write_file(
    name: str, path: str, data: Data, mode: Optional[int], mkdirs: bool, atomic: bool
) -> Call:
    query = _q(
        path=path,
        mode=None if mode is None else format(mode, "04o"),
        mkdirs=mkdirs,
        atomic=None if atomic else "0",
    )
    body: Union[bytes, IO[bytes]]
    if isinstance(data, str):
        body = data.encode()
        length = len(body)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        body = bytes(data)
        length = len(body)
    else:
        # A plain binary file on disk is sent as it is read (exactly its size from here), so a
        # file of any size never sits in memory; anything else (a compressed or text stream,
        # a pipe, a /proc file) is read whole first, as its size on disk is not its length.
        length = -1
        if isinstance(data, (io.BufferedReader, io.FileIO)):
            try:
                st = os.fstat(data.fileno())
                if stat.S_ISREG(st.st_mode):
                    length = st.st_size - data.tell()
            except (OSError, ValueError):
                pass
        if length >= 0:
            body = cast(IO[bytes], _Exactly(data, length))
        else:
            whole = data.read()
            if isinstance(whole, str):
                raise TypeError("files.write takes bytes, str or a binary file, not a text file")
            body, length = bytes(whole), len(whole)
    return Call(
        "PUT",
        sandbox_path(name, "/vm/files" + query),
        body,
        length,
        parse=lambda s, b: int(_json(s, b)["bytes"]),
        timeout=None,
    )


class _Exactly(io.RawIOBase):
    """`length` bytes of a file, no more, and an error if it ends sooner (it shrank while
    being sent): the manager is told that length, so it must be what it gets."""

    def __init__(self, inner: IO[bytes], length: int) -> None:
        self._inner = inner
        self._left = length

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self._left == 0:
            return b""
        want = self._left if size is None or size < 0 else min(size, self._left)
        data = self._inner.read(want)
        if not data:
            raise MayflyError(f"the file being written ended {self._left} bytes early: it shrank")
        self._left -= len(data)
        return data


def read_file(name: str, path: str, sink: Optional[IO[bytes]]) -> Call:
    return Call(
        "GET",
        sandbox_path(name, "/vm/files" + _q(path=path)),
        parse=lambda s, b: b,
        sink=sink,
        timeout=None,
    )


def remove_file(name: str, path: str, recursive: bool) -> Call:
    return Call("DELETE", sandbox_path(name, "/vm/files" + _q(path=path, recursive=recursive)))


def stat_file(name: str, path: str, follow: bool) -> Call:
    def parse(status: int, body: bytes) -> Stat:
        v = _json(status, body)
        return Stat(v["type"], v["size"], v["mode"], v["mtime_ms"], v["uid"], v["gid"])

    return Call(
        "GET",
        sandbox_path(name, "/vm/files/stat" + _q(path=path, follow=None if follow else "0")),
        parse=parse,
    )


def list_dir(name: str, path: str) -> Call:
    def parse(status: int, body: bytes) -> List[Entry]:
        v = _json(status, body)
        if v.get("truncated"):
            raise MayflyError(
                f"{path} has {v.get('count')} entries, more than one listing returns: "
                "list it with exec (e.g. `find`) instead"
            )
        return [
            Entry(e["name"], e["type"], e["size"], e["mode"], e["mtime_ms"]) for e in v["entries"]
        ]

    return Call("GET", sandbox_path(name, "/vm/files/list" + _q(path=path)), parse=parse)


def make_dir(name: str, path: str, mode: Optional[int], parents: bool) -> Call:
    query = _q(path=path, mode=None if mode is None else format(mode, "04o"), parents=parents)
    return Call("PUT", sandbox_path(name, "/vm/files/dir" + query))


def _body(value: Any) -> bytes:
    return json.dumps(value).encode()


# --- the connection ------------------------------------------------------------------------


def resolve(
    sock: Optional[str], token: Optional[str], state_dir: Optional[str]
) -> Tuple[str, Optional[str]]:
    """The manager's socket and token: as given, or from ``MAYFLY_SOCK``, ``MAYFLY_TOKEN`` and
    ``MAYFLY_STATE_DIR`` (whose ``admin.token`` is read when no token is given)."""
    sock = sock or os.environ.get("MAYFLY_SOCK")
    if not sock:
        raise MayflyError(
            "no manager socket: pass sock= (the --sock of `mayfly serve`) or set MAYFLY_SOCK"
        )
    # What the caller passed wins over the environment: token=, then state_dir=, then
    # MAYFLY_TOKEN, then MAYFLY_STATE_DIR.
    if token is None and state_dir is None:
        token = os.environ.get("MAYFLY_TOKEN")
        if token is None:
            state_dir = os.environ.get("MAYFLY_STATE_DIR")
    if token is None and state_dir:
        path = os.path.join(state_dir, "admin.token")
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise MayflyError(f"cannot read the admin token {path}: {e} (run as its owner)")
    return os.fspath(sock), token


def request_head(call: Call, token: Optional[str], length: Optional[int]) -> bytes:
    lines = [f"{call.method} {call.path} HTTP/1.1", "Host: mayfly", "Connection: close"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    if call.body is not None:
        lines.append("Content-Type: application/octet-stream" if call.length is not None else "Content-Type: application/json")
    lines.append(f"Content-Length: {length or 0}")
    lines.extend(f"{k}: {v}" for k, v in call.headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def body_length(call: Call) -> int:
    if call.body is None:
        return 0
    if call.length is not None:
        return call.length
    assert isinstance(call.body, bytes)
    return len(call.body)
