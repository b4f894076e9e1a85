"""`GET /dashboard`: the live cluster page. One self-contained HTML file
(router/observe/static/dashboard.html: inline CSS, JS and SVG; no CDN, no build step) that fetches
`GET /v1/cluster` (router/observe/cluster_view.py) every second and draws pool occupancy bars per
worker, hit-rate and TTFT sparklines, and a heat strip of which worker holds which of the
hottest prefixes.

The page itself carries no data, so it is open like /health; with API keys configured its
data (/v1/cluster) needs a key like every other route: the page sends `?key=...` from its URL
as `Authorization: Bearer`, or asks for one when the router answers 401.

Owner: `RouterMetrics.add_routes` (router/observe/metrics.py) registers it. torch-free.
"""
from __future__ import annotations

from importlib import resources

from aiohttp import web

DASHBOARD_PATH = "/dashboard"


def dashboard_html() -> bytes:
    """The page, as shipped in the package (package data)."""
    return resources.files("router.observe").joinpath("static", "dashboard.html").read_bytes()


async def _dashboard(request: web.Request) -> web.Response:
    return web.Response(body=dashboard_html(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


def add_dashboard_routes(app: web.Application) -> None:
    app.add_routes([web.get(DASHBOARD_PATH, _dashboard)])
