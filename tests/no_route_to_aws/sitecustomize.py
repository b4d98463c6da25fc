"""No route to AWS, for a function run by tests/lambda_emulator.py: Python imports this
module at start-up (`site`) because its directory is first on the function's PYTHONPATH,
and it installs an audit hook (PEP 578) that refuses, with a PermissionError naming the
host, every connection that would leave the machine:

- `socket.connect`/`socket.connect_ex` of an internet socket to an address that is not
  loopback (127.0.0.0/8, ::1, or the name `localhost`); a Unix socket path is allowed;
- `socket.sendto`/`socket.sendmsg` likewise (a datagram to a DNS server, the X-Ray daemon);
- `socket.getaddrinfo`, `socket.gethostbyname(_ex)` of any name other than `localhost` or a
  loopback literal, so that even the look-up of an AWS endpoint fails.

Each refusal is also written to stderr (the function's log) as one line starting with
REFUSAL, since an SDK may wrap the PermissionError in an error of its own (botocore's
EndpointConnectionError) whose message no longer says why.

What it sees is what goes through Python's socket module: boto3/botocore (urllib3),
urllib, http.client. A C library's own sockets (libpq's, awslambdaric's curl, which talks
to the emulator on 127.0.0.1) are not audited; the tests give the function a database on
127.0.0.1 or a Unix socket.
"""

import ipaddress
import os
import socket
import sys

REFUSAL = "no-route-to-aws: refused"
LOCAL_NAMES = {"localhost", "localhost.", "ip6-localhost"}


def _host_text(host) -> str:
    return host.decode(errors="replace") if isinstance(host, bytes | bytearray) else str(host)


def _is_loopback(host) -> bool:
    if host is None:  # getaddrinfo(None, ...): this machine's own (passive) addresses
        return True
    text = _host_text(host).strip("[]").split("%", 1)[0].lower()
    if text == "" or text in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def _refuse(event: str, host, port=None) -> None:
    where = _host_text(host) if port is None else f"{_host_text(host)}:{port}"
    message = f"{REFUSAL} {event} to {where} (the emulator's function has no route off 127.0.0.1)"
    try:
        os.write(2, (message + "\n").encode(errors="replace"))
    except OSError:
        pass
    raise PermissionError(message)


def _check_address(event: str, sock, address) -> None:
    family = getattr(sock, "family", None)
    if family not in (socket.AF_INET, socket.AF_INET6):
        return  # a Unix socket path, netlink, ...: nothing leaves the machine
    if isinstance(address, tuple) and address:
        host, port = address[0], address[1] if len(address) > 1 else None
        if not _is_loopback(host):
            _refuse(event, host, port)


def _hook(event: str, args: tuple) -> None:
    if not event.startswith("socket."):
        return
    if event in ("socket.connect", "socket.connect_ex"):
        _check_address(event, args[0], args[1])
    elif event == "socket.sendto":
        _check_address(event, args[0], args[1])
    elif event == "socket.sendmsg":
        if args[1] is not None:
            _check_address(event, args[0], args[1])
    elif event == "socket.getaddrinfo":
        if not _is_loopback(args[0]):
            _refuse(event, args[0], args[1])
    elif event in ("socket.gethostbyname", "socket.gethostbyname_ex"):
        if not _is_loopback(args[0]):
            _refuse(event, args[0])


sys.addaudithook(_hook)
