"""The blocking client: :class:`Client` (a connection to ``mayfly serve``) and
:class:`Sandbox` (one sandbox by name). Each request is one HTTP/1.1 exchange over the
manager's Unix socket, made with the standard library's ``http.client``."""

from __future__ import annotations

import http.client
import socket
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from . import _api
from ._api import Call, Command, Data, Entry, Result, Stat, Template
from .errors import Busy, ManagerUnreachable, MayflyError, NotFound, TimedOut

#: Statuses a readiness wait keeps trying through: the guest agent is not up yet.
_NOT_READY = (503, 504)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("mayfly", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Client:
    """A connection to ``mayfly serve``: its socket and a token (the admin token creates,
    lists and forks sandboxes; a sandbox's own token reaches only that sandbox).

    With no arguments it uses ``MAYFLY_SOCK`` and ``MAYFLY_TOKEN`` (or the ``admin.token`` in
    ``MAYFLY_STATE_DIR``)."""

    def __init__(
        self,
        sock: Optional[str] = None,
        token: Optional[str] = None,
        state_dir: Optional[str] = None,
        timeout: float = _api.DEFAULT_TIMEOUT,
    ) -> None:
        self.sock, self.token = _api.resolve(sock, token, state_dir)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"mayfly.Client(sock={self.sock!r})"

    def do(self, call: Call, token: Optional[str] = None) -> Any:
        """Send one request and parse its answer (or raise the manager's error)."""
        timeout = self.timeout if call.timeout == _api.DEFAULT_TIMEOUT else call.timeout
        conn = _UnixConnection(self.sock, timeout)
        try:
            try:
                conn.putrequest(call.method, call.path, skip_host=True, skip_accept_encoding=True)
                conn.putheader("Host", "mayfly")
                conn.putheader("Connection", "close")
                use = token or self.token
                if use:
                    conn.putheader("Authorization", f"Bearer {use}")
                conn.putheader("Content-Length", str(_api.body_length(call)))
                conn.endheaders()
                try:
                    if call.body is not None:
                        conn.send(call.body)
                except (BrokenPipeError, ConnectionResetError):
                    # The manager refused before reading all of it (a bad token, an unknown
                    # sandbox, too large a body...): its answer may be waiting.
                    pass
                response = conn.getresponse()
            except FileNotFoundError:
                raise ManagerUnreachable(
                    f"no manager at {self.sock}: is `mayfly serve --sock {self.sock}` running?"
                ) from None
            except ConnectionRefusedError:
                raise ManagerUnreachable(
                    f"the manager at {self.sock} refuses connections: it has stopped "
                    "(start `mayfly serve` again on the same --state-dir; it finds its sandboxes)"
                ) from None
            except socket.timeout:
                raise TimedOut(
                    f"{call.method} {call.path}: no answer in {timeout} s", None
                ) from None
            except (OSError, http.client.HTTPException) as e:
                raise ManagerUnreachable(
                    f"{call.method} {call.path}: the manager at {self.sock} went away ({e})"
                ) from None
            return self._answer(call, response, timeout)
        finally:
            conn.close()

    def _answer(self, call: Call, response: http.client.HTTPResponse, timeout: Any) -> Any:
        try:
            if not 200 <= response.status < 300:
                _api.raise_for(response.status, response.read())
            if call.stream is not None:
                while True:
                    line = response.readline()
                    if not line:
                        break
                    call.stream.feed(line)
                return call.parse(response.status, b"")
            if call.sink is not None:
                while True:
                    piece = response.read(1 << 16)
                    if not piece:
                        break
                    call.sink.write(piece)
                return None
            return call.parse(response.status, response.read())
        except socket.timeout:
            raise TimedOut(f"{call.method} {call.path}: the answer stopped for {timeout} s") from None
        except http.client.IncompleteRead as e:
            raise ManagerUnreachable(
                f"{call.method} {call.path}: the answer was cut off ({e}); the sandbox's VMM "
                "or the manager went away"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            raise ManagerUnreachable(f"{call.method} {call.path}: the answer broke off ({e})") from None

    # The manager as a whole.

    def sandboxes(self) -> List[Dict[str, Any]]:
        """Every sandbox the manager knows, described (needs the admin token)."""
        return self.do(_api.list_sandboxes())  # type: ignore[no-any-return]

    def verify_credential(
        self, credential: str, audience: Optional[str] = None
    ) -> Dict[str, Any]:
        """Which sandbox a credential (from a guest's ``/run/mayfly/sandbox.json``) belongs to
        and whom it acts for: ``{"valid": True, "sandbox": ..., "acts_for": ...}``, or
        ``{"valid": False, "error": ...}`` (needs the admin token). With ``audience``, valid
        only if it was minted for that one."""
        return self.do(_api.verify_credential(credential, audience))  # type: ignore[no-any-return]

    def metrics(self) -> str:
        """The manager's Prometheus text."""
        return self.do(_api.metrics())  # type: ignore[no-any-return]


_default: Optional[Client] = None


def default_client() -> Client:
    """The client made from the environment (``MAYFLY_SOCK``, ``MAYFLY_TOKEN``), once."""
    global _default
    if _default is None:
        _default = Client()
    return _default


class Files:
    """A sandbox's files, through its guest agent."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sb = sandbox

    def write(
        self,
        path: str,
        data: Data,
        mode: Optional[int] = None,
        mkdirs: bool = False,
        atomic: bool = True,
    ) -> int:
        """Write ``data`` (bytes, text or a binary file object, streamed) to ``path``;
        returns the bytes written. ``mkdirs`` makes missing parent directories; the file
        appears whole or not at all unless ``atomic=False``."""
        return self._sb._do(_api.write_file(self._sb.name, path, data, mode, mkdirs, atomic))  # type: ignore[no-any-return]

    def read(self, path: str) -> bytes:
        return self._sb._do(_api.read_file(self._sb.name, path, None))  # type: ignore[no-any-return]

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def download(self, path: str, into: IO[bytes]) -> None:
        """Copy the guest's file into a binary file object as it arrives."""
        self._sb._do(_api.read_file(self._sb.name, path, into))

    def list(self, path: str) -> List[Entry]:
        return self._sb._do(_api.list_dir(self._sb.name, path))  # type: ignore[no-any-return]

    def stat(self, path: str, follow: bool = True) -> Stat:
        return self._sb._do(_api.stat_file(self._sb.name, path, follow))  # type: ignore[no-any-return]

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except NotFound:
            return False
        return True

    def remove(self, path: str, recursive: bool = False) -> None:
        self._sb._do(_api.remove_file(self._sb.name, path, recursive))

    def mkdir(self, path: str, mode: Optional[int] = None, parents: bool = True) -> None:
        self._sb._do(_api.make_dir(self._sb.name, path, mode, parents))


class Sandbox:
    """A sandbox by name: its own VMM process under ``mayfly serve``. Requests for it use its
    own token when it has one (the one its create or fork answered), the client's otherwise.
    A sandbox asleep on disk wakes for any request, transparently.

    ``with Sandbox.create() as sb: ...`` deletes it on leaving the block."""

    def __init__(self, name: str, token: Optional[str] = None, client: Optional[Client] = None):
        self.name = _api.check_name(name)
        self.token = token
        self.client = client or default_client()
        self.files = Files(self)
        self.created: Dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"mayfly.Sandbox({self.name!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.delete()
        except NotFound:
            pass

    def _do(self, call: Call) -> Any:
        return self.client.do(call, None if call.admin else self.token)

    @classmethod
    def create(
        cls,
        template: Union[Template, Mapping[str, Any], None] = None,
        name: Optional[str] = None,
        idle_timeout: Optional[float] = None,
        network: Optional[str] = None,
        *,
        snapshot: Optional[str] = None,
        client: Optional[Client] = None,
        wait: bool = True,
        ready_timeout: float = 300.0,
        **spec: Any,
    ) -> "Sandbox":
        """A new sandbox: from ``template`` (built once and cached by the manager; a create
        is then a restore), from a ``snapshot`` directory, or (neither) a boot of the built-in
        guest. ``idle_timeout`` (seconds) puts it to sleep on disk after that long without a
        request; ``network`` is as ``mayfly run --net``; other keyword arguments go into the
        create request as they are (``mem_mib=``, ``vcpus=``, ``rootfs=``...). With ``wait``
        it returns once its guest agent answers, so the first exec does not wait for a boot."""
        client = client or default_client()
        name = name or _api.new_name()
        try:
            answer = client.do(_api.create(name, template, idle_timeout, network, snapshot, spec))
        except (TimedOut, ManagerUnreachable) as e:
            # The manager may still make it: it is not left behind unnamed.
            try:
                client.do(_api.delete(name))
            except MayflyError:
                pass
            raise type(e)(f"creating sandbox {name}: {e} (deleted if it was made)", e.status) from None
        sandbox = cls(answer["name"], answer.get("token"), client)
        sandbox.created = answer
        if wait and not _api.agentless(answer):
            try:
                sandbox.wait_ready(ready_timeout)
            except BaseException:
                # Nothing half-made is left behind.
                try:
                    sandbox.delete()
                except MayflyError:
                    pass
                raise
        return sandbox

    @classmethod
    def connect(
        cls, name: str, token: Optional[str] = None, client: Optional[Client] = None
    ) -> "Sandbox":
        """An existing sandbox (``NotFound`` or ``Unauthorized`` if there is none)."""
        sandbox = cls(name, token, client)
        sandbox.info()
        return sandbox

    @classmethod
    def list(cls, client: Optional[Client] = None) -> List["Sandbox"]:
        client = client or default_client()
        return [cls(s["name"], None, client) for s in client.sandboxes()]

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until the guest agent answers (a booting guest's first exec would wait for it)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._do(_api.agent(self.name, timeout=30.0))
                return
            except (Busy, TimedOut) as e:
                if time.monotonic() >= deadline:
                    raise TimedOut(
                        f"sandbox {self.name}: its guest agent did not answer in {timeout} s "
                        f"({e}); its console log is in the manager's state directory"
                    ) from None
                time.sleep(0.2)

    def info(self) -> Dict[str, Any]:
        """Its description: state, pid, wakes, suspends, idle time..."""
        return self._do(_api.describe(self.name))  # type: ignore[no-any-return]

    @property
    def state(self) -> str:
        return str(self.info()["state"])

    def exec(
        self,
        cmd: Command,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Optional[Union[str, bytes]] = None,
        on_stdout: Optional[Callable[[str], None]] = None,
        on_stderr: Optional[Callable[[str], None]] = None,
        user: Optional[Union[str, int]] = None,
        check: bool = False,
    ) -> Result:
        """Run ``cmd`` in the guest (a string through ``/bin/sh -c``, a list as it is) and
        return its verdict. ``timeout`` (seconds) kills it after that long; ``on_stdout`` /
        ``on_stderr`` get its output as it comes. A non-zero exit raises only with ``check``."""
        result: Result = self._do(
            _api.exec_call(self.name, cmd, env, cwd, timeout, stdin, user, on_stdout, on_stderr)
        )
        return result.check() if check else result

    def pause(self) -> Dict[str, Any]:
        """Sleep to disk now: a snapshot, then its VMM exits and its RAM is freed."""
        return self._do(_api.pause(self.name))  # type: ignore[no-any-return]

    def resume(self) -> Dict[str, Any]:
        """Wake now (any request would wake it anyway)."""
        return self._do(_api.resume(self.name))  # type: ignore[no-any-return]

    def snapshot(self, path: str) -> Dict[str, Any]:
        """Write a snapshot of it to the directory ``path`` on the manager's host (admin);
        ``Sandbox.create(snapshot=path)`` makes a sandbox from it."""
        return self._do(_api.snapshot(self.name, path))  # type: ignore[no-any-return]

    def fork(
        self,
        n: Optional[int] = None,
        names: Optional[Sequence[str]] = None,
        idle_timeout: Optional[float] = None,
    ) -> List["Sandbox"]:
        """``n`` new sandboxes (or one per name in ``names``), each a copy of this one as it
        is now, running, with its own name, token and identity (admin)."""
        answer = self._do(_api.fork(self.name, n, names, idle_timeout))
        clones = []
        for c in answer["clones"]:
            clone = type(self)(c["name"], c.get("token"), self.client)
            clone.created = c
            clones.append(clone)
        return clones

    def set_policy(self, policy: str) -> Dict[str, Any]:
        """Change what its network may reach, now (admin): ``none``, ``open`` or
        ``allow=CIDR[:PORT]|NAME[:PORT],...``. Answers the network as it is then."""
        return self._do(_api.set_policy(self.name, policy))  # type: ignore[no-any-return]

    def expose(self, guest_port: int, host: Optional[str] = None) -> Dict[str, Any]:
        """Listen on the host for ``guest_port`` of its guest (admin): at ``host``
        (``tcp:127.0.0.1:PORT`` or ``unix:/path``; default a free loopback port), kept by the
        manager across sleep and wake; a connection wakes a sleeping sandbox. Answers
        ``{"guest_port": ..., "host": "tcp:127.0.0.1:41234"}``."""
        return self._do(_api.expose_port(self.name, guest_port, host))  # type: ignore[no-any-return]

    def ports(self) -> List[Dict[str, Any]]:
        """Its guest ports exposed on the host."""
        return self._do(_api.list_ports(self.name))  # type: ignore[no-any-return]

    def close_port(self, guest_port: int) -> None:
        """Stop exposing ``guest_port`` (admin)."""
        self._do(_api.close_port(self.name, guest_port))

    def renew_token(self) -> str:
        """A new token for it (the old one stops working), which this object now uses."""
        self.token = self._do(_api.renew_token(self.name))
        assert self.token is not None
        return self.token

    def revoke_token(self) -> None:
        """Revoke its token; this object then speaks with the client's token."""
        self._do(_api.revoke_token(self.name))
        self.token = None

    def mint_credential(
        self, audience: Optional[str] = None, ttl: Optional[float] = None
    ) -> Dict[str, Any]:
        """A new credential for its guest (admin), for ``audience`` and ``ttl`` seconds if
        given; the one before stops verifying. The answer holds it (``credential``) and
        whether the guest got it (``delivered``: a guest without an agent does not)."""
        return self._do(_api.mint_credential(self.name, audience, ttl))  # type: ignore[no-any-return]

    def revoke_credential(self) -> None:
        """Revoke its credential (admin): none of its credentials verifies until the next."""
        self._do(_api.revoke_credential(self.name))

    def delete(self) -> None:
        """End its VMM and remove everything of it."""
        self._do(_api.delete(self.name))
