"""The page's HTTP side: `/flowactors` (the page, a static file) and `/flowactors/data.json` on the dashboard.

The routes (and `/flowactors/stack.json`, a running task's stack) are added to the scheduler's running tornado application, under its URL prefix, once per scheduler
(`add_routes`); the handlers look the plugin up on every request (through the `find_plugin` the plugin hands them,
so this module knows nothing of the plugin's class), so a plugin unregistered and registered again is served without
a second set of routes. The page (`page.html` beside this module: inline SVG, CSS and JS,
no CDN, so it works offline and with the dashboard bound to 127.0.0.1) is read once, at its first request, and
polls data.json every 1.5 s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import tornado.routing
from tornado import web

__all__ = ["add_routes", "page"]


def add_routes(app: Any, scheduler: Any, find_plugin: Callable[[Any], Any]) -> None:
    """Serve the page and its data on `app` (the scheduler's dashboard), unless this scheduler already does;
    `find_plugin(scheduler)` returns the plugin registered there now, or None."""
    if getattr(app, "_flowactors_routes", False):
        return
    prefix = _http_prefix(app)
    kw = {"scheduler": scheduler, "data_url": f"{prefix}flowactors/data.json", "find_plugin": find_plugin}
    app.add_handlers(
        r".*",
        [
            (rf"{prefix}flowactors/?", _PageHandler, kw),
            (rf"{prefix}flowactors/data\.json", _DataHandler, kw),
            (rf"{prefix}flowactors/stack\.json", _StackHandler, kw),
        ],
    )
    app._flowactors_routes = True


@functools.cache
def page() -> str:
    """The page's HTML (`page.html`, shipped with the package); `__DATA_URL__` stands for its data's URL."""
    return resources.files("flowactors.dashboard").joinpath("page.html").read_text(encoding="utf-8")


def _http_prefix(app: Any) -> str:
    """The dashboard's URL prefix (`Scheduler(http_prefix=...)`), read off the route of its /health page."""
    stack = [app.wildcard_router, app.default_router]
    while stack:
        router = stack.pop()
        for rule in getattr(router, "rules", ()):
            if isinstance(rule.target, tornado.routing.RuleRouter):
                stack.append(rule.target)
            elif isinstance(rule.matcher, tornado.routing.PathMatches):
                pattern = rule.matcher.regex.pattern.rstrip("$")
                if pattern.endswith("/health"):
                    return pattern[: -len("health")]
    return "/"


class _Handler(web.RequestHandler):
    def initialize(self, scheduler: Any, data_url: str, find_plugin: Callable[[Any], Any]) -> None:
        self.dask_scheduler, self.data_url, self.find_plugin = scheduler, data_url, find_plugin

    def plugin(self) -> Any:
        return self.find_plugin(self.dask_scheduler)

    def require_plugin(self) -> Any:
        p = self.plugin()
        if p is None:
            self.set_status(404)
            self.write(
                {
                    "error": "the flowactors dashboard plugin is not registered on this scheduler; "
                    "call flowactors.dashboard.install_dashboard(client)"
                }
            )
        self.set_header("Cache-Control", "no-store")
        return p


class _PageHandler(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(page().replace("__DATA_URL__", json.dumps(self.data_url)))


class _DataHandler(_Handler):
    """data.json; `?step=N` shows step N's graph while it is kept (the page offers the kept steps)."""

    def get(self) -> None:
        p = self.require_plugin()
        if p is None:
            return
        step = self.get_argument("step", None)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(p.data(int(step) if step and step.lstrip("-").isdigit() else None)))


class _StackHandler(_Handler):
    """stack.json?key=K: the stack of the rank running call task K now (a slow call's link)."""

    async def get(self) -> None:
        p = self.require_plugin()
        if p is None:
            return
        try:
            found = await p.stack(self.get_argument("key"))
        except KeyError as e:
            self.set_status(404)
            self.write({"error": str(e.args[0])})
            return
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(found))
