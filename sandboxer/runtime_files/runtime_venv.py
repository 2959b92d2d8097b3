"""runtime-venv DIR: a venv at DIR whose Python also imports the runtime's packages.

Installed by build-runtime.py as `bin/runtime-venv` of every runtime it builds (docs/agent-guide.md,
"Packages on top of the runtime"). The runtime is read-only, and a venv made from it with
`python3 -m venv --system-site-packages` would see the system's packages, not the runtime's (a
venv's base is the interpreter the runtime itself was made from). This venv's own packages come
first; the runtime's site-packages follow (a `.pth` line), so its packages import as they are;
pip leaves them alone (they lie outside its environment), so an upgrade shadows the runtime's
version instead of failing on the read-only tree.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import venv


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.stderr.write("usage: runtime-venv DIR\n")
        return 2
    target = os.path.abspath(argv[0])
    venv.EnvBuilder(with_pip=True, symlinks=True).create(target)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = os.path.join(target, "lib", version, "site-packages")
    with open(os.path.join(site, "sandboxer-runtime.pth"), "w") as pth:
        pth.write(sysconfig.get_paths()["purelib"] + "\n")
    sys.stdout.write(f"{target}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
