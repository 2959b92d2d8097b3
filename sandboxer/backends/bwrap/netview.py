"""The network namespace of a live sandbox, read through netlink (pyroute2) from inside it.

A forked child joins the namespace (through the sandbox's user namespace when the broker is
not root), opens a netlink socket there and reports interfaces and routes over a pipe. The
broker process itself never changes namespace.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from pyroute2 import IPRoute

from sandboxer.backends.bwrap import privileges
from sandboxer.errors import BackendError


def _collect() -> dict[str, Any]:

    with IPRoute() as ipr:
        interfaces = sorted(str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links())
        routes = []
        for family in (socket.AF_INET, socket.AF_INET6):
            for route in ipr.route("dump", family=family):
                table = route.get_attr("RTA_TABLE") or route["table"]
                dst = route.get_attr("RTA_DST")
                oif = route.get_attr("RTA_OIF")
                routes.append(
                    {
                        "family": "inet" if family == socket.AF_INET else "inet6",
                        "table": table,
                        "dst": f"{dst}/{route['dst_len']}" if dst else "default",
                        "oif": oif,
                    }
                )
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        for route in routes:
            route["dev"] = names.get(route.pop("oif"))
    return {"interfaces": interfaces, "routes": routes}


def observe_network(holder_pid: int) -> dict[str, Any]:
    """Interfaces and routes (all tables) of the network namespace `holder_pid` lives in."""
    try:
        net_fd = os.open(f"/proc/{holder_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        user_fd = privileges.owning_user_namespace(net_fd)
    except OSError as exc:
        raise BackendError(f"cannot open the sandbox's network namespace ({exc.strerror})") from None
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        status = 0
        try:
            os.close(read_end)
            if os.geteuid() != 0:
                privileges.setns(user_fd, privileges.CLONE_NEWUSER)
            privileges.setns(net_fd, privileges.CLONE_NEWNET)
            os.write(write_end, json.dumps(_collect()).encode())
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    os.close(user_fd)
    os.close(net_fd)
    with os.fdopen(read_end, "rb") as stream:
        data = stream.read()
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not data:
        raise BackendError("cannot read the sandbox's network namespace")
    result: dict[str, Any] = json.loads(data)
    return result
