"""Fetch the web view's charting library, uPlot, into web/vendor/ (docs/web-view.md).

    python3 tools/vendor_uplot.py          # fetch the pinned release, check it, write it
    python3 tools/vendor_uplot.py --check  # fetch it and compare with what is committed

The service serves these files itself (/admin/static/vendor/...): a browser loads nothing
from another origin, and the pages' CSP stays `script-src 'self'`. The release is pinned
by version and by the npm registry's own integrity hash of its tarball, and each file
written by its SHA-256 (tests/test_web_view_assets.py checks the committed files against
FILES without a network). To move to a newer release: change VERSION and INTEGRITY (`npm
view uplot@X dist.integrity`), run this, and put the new files' hashes in FILES.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "1.6.32"
TARBALL = f"https://registry.npmjs.org/uplot/-/uplot-{VERSION}.tgz"
INTEGRITY = (
    "sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyT"
    "xpiQIw=="
)
VENDOR = Path(__file__).resolve().parent.parent / "web" / "vendor"
# The tarball's file -> (the name in web/vendor/, its SHA-256).
FILES = {
    "package/dist/uPlot.iife.min.js": (
        "uPlot.iife.min.js",
        "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
    ),
    "package/dist/uPlot.min.css": (
        "uPlot.min.css",
        "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
    ),
    "package/LICENSE": (
        "uPlot.LICENSE",
        "8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd",
    ),  # MIT: the licence travels with the code
}


def fetch() -> dict[str, bytes]:
    """The pinned release's files, by their names in web/vendor/, each checked."""
    with urllib.request.urlopen(TARBALL, timeout=60) as answer:
        tarball = answer.read()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if digest != INTEGRITY:
        raise SystemExit(f"uplot {VERSION}: the tarball's integrity is {digest}, not {INTEGRITY}")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        for member, (name, sha256) in FILES.items():
            extracted = archive.extractfile(member)
            if extracted is None:
                raise SystemExit(f"uplot {VERSION}: {member} is not a file in the tarball")
            content = extracted.read()
            if hashlib.sha256(content).hexdigest() != sha256:
                raise SystemExit(f"uplot {VERSION}: {member} is not the pinned file")
            files[name] = content
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    files = fetch()
    if args.check:
        differ = [
            name for name, content in files.items() if (VENDOR / name).read_bytes() != content
        ]
        if differ:
            print(f"web/vendor/ differs from uplot {VERSION}: {', '.join(differ)}", file=sys.stderr)
            return 1
        print(f"web/vendor/ holds uplot {VERSION}, as pinned")
        return 0
    VENDOR.mkdir(exist_ok=True)
    for name, content in files.items():
        (VENDOR / name).write_bytes(content)
        print(f"web/vendor/{name}  sha256 {hashlib.sha256(content).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
