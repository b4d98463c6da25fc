"""The web view's charting library (docs/web-view.md, "The charting library"): the files
in web/vendor/ are the pinned release's, byte for byte (tools/vendor_uplot.py pins each by
its SHA-256; CI's `tools/vendor_uplot.py --check` compares them with a fresh fetch), the
licence travels with them, and the service serves each from its own origin."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest

import handler

pytestmark = pytest.mark.no_database


def vendor_tool():
    spec = importlib.util.spec_from_file_location(
        "vendor_uplot", handler.HERE / "tools" / "vendor_uplot.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_the_pinned_release():
    tool = vendor_tool()
    committed = {p.name for p in (handler.WEB_DIR / "vendor").iterdir()}
    assert committed == {name for name, _ in tool.FILES.values()}
    for name, sha256 in tool.FILES.values():
        content = (handler.WEB_DIR / "vendor" / name).read_bytes()
        assert hashlib.sha256(content).hexdigest() == sha256, name
    licence = (handler.WEB_DIR / "vendor" / "uPlot.LICENSE").read_text()
    assert licence.startswith("The MIT License") and "Leon Sorokin" in licence


def test_every_vendored_file_is_served_and_the_page_links_the_library():
    served = {
        path: name for path, (_, name) in handler.ADMIN_ASSETS.items() if name.startswith("vendor/")
    }
    assert sorted(served.values()) == sorted(
        f"vendor/{name}" for name, _ in vendor_tool().FILES.values()
    )
    routes = {path for method, path, *_ in handler.ADMIN_ROUTES if method == "GET"}
    assert set(served) <= routes
    page = (handler.WEB_DIR / "admin.html").read_text()
    # The library before the page's own script (both deferred: run in this order).
    assert page.index("/admin/static/vendor/uPlot.iife.min.js") < page.index(
        "/admin/static/admin.js"
    )
    assert "/admin/static/vendor/uPlot.min.css" in page
    assert "http:" not in page and "https:" not in page  # nothing from another origin
